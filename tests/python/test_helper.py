"""The Python helper itself, on the host upstream (runs everywhere, CI included)."""
import pytest
from conftest import INSTALLED, ok, run_py, with_batch_rule


def test_stats_status_json_reclaim_limits_on_host(library):
    out = ok(run_py("""
        import ctypes, gpupool
        gpupool.configure(0, pool="split", upstream="host")
        L = gpupool.lib()
        p = ctypes.c_void_p()
        assert L.gpupool_malloc(ctypes.byref(p), 3 << 20, 0, None) == 0
        s = gpupool.stats(0)
        assert s["used_bytes"] == 3 << 20 and s["n_live_blocks"] == 1, s
        j = gpupool.stats_json(0)
        assert j["used_bytes"] == s["used_bytes"] and j["upstream"] == "host", j
        assert "3.00 MiB in use" in gpupool.memory_status(0)
        leaks = gpupool.report_leaks()
        assert "1 live allocation(s), 3.00 MiB outstanding" in leaks, leaks
        gpupool.set_limit("64MiB", 0)
        assert gpupool.get_limit(0) == 64 << 20
        assert L.gpupool_free(p, 0, None) == 0
        try:
            gpupool._check(L.gpupool_free(p, 0, None))
            raise SystemExit("double free not reported")
        except gpupool.GpupoolError as e:
            assert e.status == 3 and "double free" in str(e), e
        assert gpupool.reclaim(0) == s["total_bytes"]
        print("ok")
    """))
    assert "ok" in out


def test_the_peak_of_bytes_requested_is_reported_beside_the_blocks_peak_on_host(library):
    out = ok(run_py("""
        import ctypes, gpupool
        gpupool.configure(0, pool="arena", upstream="host")
        L = gpupool.lib()
        p, q = ctypes.c_void_p(), ctypes.c_void_p()
        assert L.gpupool_malloc(ctypes.byref(p), 3 << 20, 0, None) == 0
        assert L.gpupool_malloc(ctypes.byref(q), 1000, 0, None) == 0
        assert L.gpupool_free(p, 0, None) == 0
        s = gpupool.stats(0)
        assert s["peak_requested_bytes"] == (3 << 20) + 1000 == gpupool.stats_json(0)["peak_requested_bytes"], s
        assert s["peak_used_bytes"] == (3 << 20) + 1024 and s["requested_bytes"] == 1000, s
        assert L.gpupool_free(q, 0, None) == 0
        print("ok")
    """))
    assert "ok" in out


def test_out_of_memory_is_what_batch_size_finders_retry_smaller_on_host(library):
    # A failed allocation raised from Python (gpupool's own error class, a RuntimeError with
    # the library's text): PyTorch's phrase comes first, gpupool's report after it, and the
    # rule accelerate and toma apply recognises it. Other errors it must not.
    out = ok(run_py(with_batch_rule("""
        import ctypes, gpupool
        gpupool.configure(0, pool="split", upstream="host")
        gpupool.set_limit("64MiB", 0)
        p = ctypes.c_void_p()
        st = gpupool.lib().gpupool_malloc(ctypes.byref(p), 128 << 20, 0, None)
        assert st == 5, st
        try:
            gpupool._check(st)
            raise SystemExit("no exception")
        except RuntimeError as e:
            msg = str(e)
            assert msg.startswith("CUDA out of memory. gpupool: out of memory on device 0"), msg
            assert "limit" in msg and "Hint" in msg, msg
            assert should_reduce_batch_size(e), repr(e)
        try:
            gpupool._check(gpupool.lib().gpupool_free(ctypes.c_void_p(0x1234500), 0, None))
            raise SystemExit("no exception")
        except RuntimeError as e:
            assert not should_reduce_batch_size(e), repr(e)
        print("ok")
    """)))
    assert "ok" in out


def test_an_unknown_variable_draws_one_warning_naming_the_setting_meant(library):
    # GPUPOOL_LIMIT is no setting (GPUPOOL_MEMORY_LIMIT is): one line on stderr however many
    # calls follow. The project's own variables (GPUPOOL_LIBRARY, set by run_py; the Python
    # package's GPUPOOL_TORCH_ALLOCATOR; the tests' GPUPOOL_FAULT_OPS) draw none.
    p = run_py("""
        import gpupool
        for _ in range(3):
            gpupool.stats(0)
            gpupool.memory_status()
        print("ok")
    """, env={"GPUPOOL_LIMIT": "abc", "GPUPOOL_UPSTREAM": "host", "GPUPOOL_TORCH_ALLOCATOR": "0",
              "GPUPOOL_FAULT_OPS": "1000"})
    assert "ok" in ok(p)
    lines = [l for l in p.stderr.splitlines() if "is not a gpupool setting" in l]
    assert len([l for l in lines if "GPUPOOL_LIMIT " in l]) == 1, p.stderr
    assert "did you mean GPUPOOL_MEMORY_LIMIT?" in lines[0], lines
    for known in ("GPUPOOL_LIBRARY", "GPUPOOL_TORCH_ALLOCATOR", "GPUPOOL_FAULT_OPS", "GPUPOOL_UPSTREAM"):
        assert not any(known + " is not" in l for l in lines), p.stderr


def test_memory_status_shows_a_malformed_configuration(library):
    # The error stats() raises, not "no device pool in use yet".
    out = ok(run_py("""
        import gpupool
        text = gpupool.memory_status()
        assert "no device pool in use yet" not in text, text
        assert "GPUPOOL_MEMORY_LIMIT" in text and "lots" in text and "accepted" in text, text
        try:
            gpupool.stats(0)
            raise SystemExit("no error")
        except gpupool.GpupoolError as e:
            assert str(e) == text.strip(), (str(e), text)
        print("ok")
    """, env={"GPUPOOL_MEMORY_LIMIT": "lots", "GPUPOOL_UPSTREAM": "host"}))
    assert "ok" in out


def test_reclaim_and_a_trace_path_that_cannot_be_written_say_the_real_cause(library):
    # A malformed setting: reclaiming every device raises it, as stats does, instead of
    # reporting nothing released.
    out = ok(run_py("""
        import gpupool
        try:
            gpupool.reclaim()
            raise SystemExit("reclaim passed under a malformed setting")
        except gpupool.GpupoolError as e:
            assert e.status == 6 and "GPUPOOL_POOL" in str(e) and '"bogus"' in str(e), e
        print("reclaim says")
    """, env={"GPUPOOL_POOL": "bogus", "GPUPOOL_UPSTREAM": "host"}))
    assert "reclaim says" in out
    # A trace path in a folder that does not exist: the path quoted alone, the OS's reason after.
    out = ok(run_py("""
        import gpupool
        try:
            gpupool.stats(0)
            raise SystemExit("a pool was made with an unwritable trace")
        except gpupool.GpupoolError as e:
            assert e.status == 6, e
            assert 'GPUPOOL_TRACE="/nonexistent-gpupool/t.csv" cannot be used: No such file' in str(e), e
        print("trace says")
    """, env={"GPUPOOL_TRACE": "/nonexistent-gpupool/t.csv", "GPUPOOL_UPSTREAM": "host"}))
    assert "trace says" in out


def test_a_limit_of_the_wrong_type_and_installs_without_the_framework_say_what_is_wrong(library):
    out = ok(run_py("""
        import sys, gpupool, gpupool.torch, gpupool.cupy
        gpupool.configure(0, pool="arena", upstream="host")
        for bad in (None, 1.5, [1]):
            try:
                gpupool.set_limit(bad)
                raise SystemExit(f"{bad!r} accepted")
            except TypeError as e:
                assert "gpupool.set_limit" in str(e) and type(bad).__name__ in str(e), e
        assert gpupool.get_limit() == 0, "a refused limit changes nothing"
        # A framework that is not installed (hidden from this interpreter): its install says so.
        sys.modules["torch"] = None
        sys.modules["cupy"] = None
        for install, name in ((gpupool.torch.install, "torch"), (gpupool.cupy.install, "cupy")):
            try:
                install()
                raise SystemExit(f"installed without {name}")
            except ModuleNotFoundError as e:
                assert f"needs {name}" in str(e) and "pip install" in str(e), e
        print("says why")
    """))
    assert "says why" in out


def test_missing_library_says_what_it_looked_for():
    p = run_py("import gpupool; gpupool.lib()", env={"GPUPOOL_LIBRARY": "/nonexistent/libgpupool.so"})
    assert p.returncode != 0
    assert "libgpupool.so not found" in p.stderr and "/nonexistent/libgpupool.so" in p.stderr, p.stderr


def test_framework_frees_of_bad_pointers_are_counted_and_reported_once_on_host(library):
    # PyTorch's and CuPy's free entry points return void: a bad pointer must neither crash nor
    # change the pool; it is counted, and only the first one is written to stderr.
    p = run_py("""
        import ctypes, gpupool
        gpupool.configure(0, pool="split", upstream="host")
        L = gpupool.lib()
        L.gpupool_torch_malloc.restype = ctypes.c_void_p
        L.gpupool_torch_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        L.gpupool_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        L.gpupool_cupy_malloc.restype = ctypes.c_void_p
        L.gpupool_cupy_malloc.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        L.gpupool_cupy_free.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        t = L.gpupool_torch_malloc(1 << 20, 0, None)
        c = L.gpupool_cupy_malloc(None, 1 << 20, 0)
        before = gpupool.stats(0)
        L.gpupool_torch_free(0x7000_0000, 64, 0, None)     # never ours
        L.gpupool_cupy_free(None, 0x7000_0000, 0)          # never ours
        L.gpupool_torch_free(t + 256, 64, 0, None)         # inside a live block
        L.gpupool_cupy_free(None, c + 256, 0)              # inside a live block
        s = gpupool.stats(0)
        assert s["n_invalid_frees"] == before["n_invalid_frees"] + 4, s
        assert (s["used_bytes"], s["n_live_blocks"]) == (before["used_bytes"], before["n_live_blocks"]), s
        L.gpupool_torch_free(t, 1 << 20, 0, None)
        L.gpupool_cupy_free(None, c, 0)
        L.gpupool_torch_free(t, 1 << 20, 0, None)          # double free
        s = gpupool.stats(0)
        assert s["n_invalid_frees"] == before["n_invalid_frees"] + 5 and s["used_bytes"] == 0, s
        print("alive")
    """)
    assert "alive" in ok(p)
    assert p.stderr.count("further invalid frees are counted") == 1, p.stderr
    assert "not allocated by gpupool" in p.stderr, p.stderr


def test_installed_package_bundles_its_library():
    if not INSTALLED:
        pytest.skip("source-tree run (GPUPOOL_TEST_INSTALLED=1 tests the installed package)")
    out = ok(run_py("""
        import gpupool, os, sys
        assert "site-packages" in gpupool.__file__, gpupool.__file__
        path = gpupool.library_path()
        assert os.path.dirname(path) == os.path.dirname(gpupool.__file__), path
        assert gpupool.lib().gpupool_version().decode().startswith("0."), path
        print("bundled", os.path.basename(path))
    """))
    assert "bundled libgpupool" in out


def test_cupy_entry_point_raises_the_registered_out_of_memory_class_on_host(library):
    # gpupool_cupy_malloc raises through the Python C-API (CuPy calls it with the GIL held);
    # gpupool.cupy registers its OutOfMemoryError class. No CuPy needed: ctypes' PYFUNCTYPE
    # calls the entry point as CuPy's C path and gpupool.cupy.python_allocator do, GIL held
    # and the error raised after the call.
    out = ok(run_py("""
        import ctypes, gpupool
        gpupool.configure(0, pool="split", upstream="host")
        gpupool.set_limit("64MiB", 0)
        L = gpupool.lib()

        class PoolOutOfMemory(MemoryError):
            pass

        ctypes.pythonapi.Py_IncRef(ctypes.py_object(PoolOutOfMemory))   # the library keeps it
        L.gpupool_cupy_set_oom_error.restype, L.gpupool_cupy_set_oom_error.argtypes = None, [ctypes.c_void_p]
        L.gpupool_cupy_set_oom_error(id(PoolOutOfMemory))
        vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        malloc = ctypes.PYFUNCTYPE(vp, vp, sz, i)(gpupool._fn_address("gpupool_cupy_malloc"))
        free = ctypes.PYFUNCTYPE(None, vp, vp, i)(gpupool._fn_address("gpupool_cupy_free"))
        a = malloc(None, 48 << 20, 0)
        before = gpupool.stats(0)
        try:
            malloc(None, 32 << 20, 0)
            raise SystemExit("no exception past the limit")
        except PoolOutOfMemory as e:
            msg = str(e)
            assert msg.startswith("CUDA out of memory. gpupool: out of memory on device 0") and "limit" in msg, msg
        s = gpupool.stats(0)
        assert s["n_ooms"] == before["n_ooms"] + 1, (before, s)
        assert (s["used_bytes"], s["n_live_blocks"]) == (before["used_bytes"], before["n_live_blocks"]), (before, s)
        try:
            malloc(None, 1, -1)
            raise SystemExit("no exception for device -1")
        except RuntimeError as e:      # not out of memory: RuntimeError, not the registered class
            assert "invalid device -1" in str(e), e
        free(None, a, 0)
        b = malloc(None, 32 << 20, 0)  # fits once the user freed
        s = gpupool.stats(0)
        assert b and s["used_bytes"] == 32 << 20 and s["n_live_blocks"] == 1, s
        assert s["n_ooms"] == before["n_ooms"] + 1, s
        L.gpupool_cupy_set_oom_error(None)   # nothing registered: plain MemoryError
        try:
            malloc(None, 1 << 40, 0)
            raise SystemExit("no exception for 1 TiB")
        except MemoryError as e:
            assert type(e) is MemoryError and str(e).startswith("CUDA out of memory. gpupool: out of memory"), repr(e)
        free(None, b, 0)
        s = gpupool.stats(0)
        assert s["used_bytes"] == 0 and s["n_live_blocks"] == 0 and s["n_ooms"] == before["n_ooms"] + 2, s
        print("ok")
    """))
    assert "ok" in out


def test_the_pytorch_allocator_source_ships_with_the_package():
    # The class is compiled on the user's machine: its source must be in the package (the
    # installed wheel's too, where scripts/test.sh runs these tests against it).
    ok(run_py("""
        from gpupool import _torch_allocator as t
        assert t.SOURCE.is_file(), t.SOURCE
        text = t.SOURCE.read_text()
        assert "gpupool_torch_allocator_install" in text
        # The headers it includes ship beside it, and declare every function it takes,
        # which the library exports.
        import re, gpupool
        headers = "".join(p.read_text() for p in t.HEADERS.glob("*.h"))
        assert "typedef struct gpupool_stats" in headers, list(t.HEADERS.glob("*"))
        table = text[text.index("#define GPUPOOL_LIBRARY_FUNCTIONS(X)"):text.index("struct Library {")]
        names = re.findall(r"X\\(\\w+, (gpupool_\\w+)\\)", table)
        assert len(names) >= 20, names
        for n in names:
            assert re.search(rf"\\b{n}\\(", headers), f"{n} is not declared in the shipped headers"
            assert gpupool._fn_address(n), n
        print("ok")
    """))


def test_torch_allocator_switch_is_parsed_without_torch():
    # GPUPOOL_TORCH_ALLOCATOR decides only where install()'s `compiled` is None (the default);
    # a malformed value is an error naming the variable, the value and what is accepted.
    ok(run_py("""
        import os, gpupool
        from gpupool import _torch_allocator as t
        cases = [(None, None, (True, False)), ("1", None, (True, False)), (" On ", None, (True, False)),
                 ("0", None, (False, False)), ("off", None, (False, False)), ("", None, (False, False)),
                 ("0", True, (True, True)), (None, False, (False, False)), ("1", False, (False, False))]
        for env, arg, want in cases:
            os.environ.pop(t.ENV, None)
            if env is not None:
                os.environ[t.ENV] = env
            assert t.wanted(arg) == want, (env, arg, t.wanted(arg), want)
        for bad in ["maybe", "2", "yes please"]:
            os.environ[t.ENV] = bad
            try:
                t.wanted(None)
                raise SystemExit(f"{bad!r} accepted")
            except gpupool.GpupoolError as e:
                assert e.status == 6, e.status
                assert f'invalid value "{bad}" for GPUPOOL_TORCH_ALLOCATOR; accepted: 0 | 1' in str(e), e
        print("ok")
    """))


# A second interpreter opens an arena block of this one (host upstream: memfd granules),
# once with the descriptors passed down (`pass_fds` keeps their numbers) and once fetching
# them by pid, checks the bytes and writes through; this process then sees the writes.
IPC_CHILD = """
    import ctypes, os, sys, gpupool
    gpupool.configure(0, pool="split", upstream="host")
    desc = bytes.fromhex(sys.argv[1])
    fds = gpupool.ipc_descriptor_fds(desc)
    p = gpupool.ipc_open(desc, 0, fds=fds)
    data = ctypes.string_at(p, SIZE)
    assert data == bytes(i % 251 for i in range(SIZE)), "child reads other bytes"
    ctypes.memmove(p, b"child!", 6)
    try:
        q = gpupool.ipc_open(desc, 0)
        assert q != p and ctypes.string_at(q, 6) == b"child!"
        gpupool.ipc_close(q, 0)
        print("by pid: ok")
    except gpupool.GpupoolError as e:
        assert "pidfd" in str(e), e
        print("by pid: not allowed here:", e)
    gpupool.ipc_close(p, 0)
    try:
        gpupool.ipc_close(p, 0)
        raise SystemExit("closed twice")
    except gpupool.GpupoolError as e:
        assert e.status == 3, e
    print("child ok")
"""


def test_ipc_of_arena_memory_between_two_interpreters_on_host(library):
    out = ok(run_py("""
        import ctypes, os, subprocess, sys, textwrap, gpupool
        CHILD = os.environ["IPC_CHILD"]
        gpupool.configure(0, pool="arena", upstream="host")
        L = gpupool.lib()
        size = (3 << 20) + 777
        p = ctypes.c_void_p()
        assert L.gpupool_malloc(ctypes.byref(p), size, 0, None) == 0
        ctypes.memmove(p, bytes(i % 251 for i in range(size)), size)
        desc = gpupool.ipc_export(p.value)
        fds = gpupool.ipc_descriptor_fds(desc)
        assert len(fds) == 2, fds
        code = textwrap.dedent(CHILD).replace("SIZE", str(size))
        r = subprocess.run([sys.executable, "-c", code, desc.hex()], pass_fds=fds, capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
        print(r.stdout)
        assert ctypes.string_at(p, 6) == b"child!"
        assert ctypes.string_at(p.value + 6, 10) == bytes(i % 251 for i in range(6, 16))
        split = ctypes.c_void_p()
        gpupool.configure(1, pool="split", upstream="host")
        assert L.gpupool_malloc(ctypes.byref(split), 4096, 1, None) == 0
        try:
            gpupool.ipc_export(split.value)
            raise SystemExit("split memory exported")
        except gpupool.GpupoolError as e:
            assert e.status == 2 and "CUDA's IPC handles" in str(e) and "host upstream" in str(e), e
        assert L.gpupool_free(p, 0, None) == 0
        print("ok")
    """, env={"IPC_CHILD": IPC_CHILD}))
    assert "child ok" in out and "ok" in out


def test_raw_cupy_route_finds_the_current_stream_getter_itself_on_host(library):
    # A program that installs gpupool_cupy_malloc / _free itself (CFunctionAllocator) never
    # registers CuPy's current-stream getter: the library looks it up on its first call with
    # the GIL held, in the loaded cupy.cuda.stream module, as gpupool.cupy.install() does.
    # Here a stand-in module exports a getter that counts its calls.
    out = ok(run_py("""
        import ctypes, sys, types, gpupool
        gpupool.configure(0, pool="arena", upstream="host")
        calls = []
        def current():
            calls.append(1)
            return 0x5000            # a user stream, as CuPy's non-blocking streams are
        getter = ctypes.CFUNCTYPE(ctypes.c_ssize_t)(current)
        api = ctypes.pythonapi
        api.PyCapsule_New.restype = ctypes.py_object
        api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        NAME = b"intptr_t (void)"
        capsule = api.PyCapsule_New(ctypes.cast(getter, ctypes.c_void_p), NAME, None)
        for m in ("cupy", "cupy.cuda", "cupy.cuda.stream"):
            sys.modules[m] = types.ModuleType(m)
        sys.modules["cupy.cuda.stream"].__pyx_capi__ = {"get_current_stream_ptr": capsule}
        L = ctypes.PyDLL(gpupool.library_path())   # calls keep the GIL, as CuPy's do
        L.gpupool_cupy_malloc.restype = ctypes.c_void_p
        L.gpupool_cupy_malloc.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        L.gpupool_cupy_free.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        p = L.gpupool_cupy_malloc(None, 1 << 20, 0)
        assert p and calls, ("the getter was not found", p, calls)
        L.gpupool_cupy_free(None, p, 0)
        s = gpupool.stats(0)
        assert s["n_live_blocks"] == 0 and s["n_invalid_frees"] == 0, s
        print("ok", len(calls))
    """))
    assert out.startswith("ok")


OTHER_USER_CHILD = """
import sys, gpupool
gpupool.configure(0, pool="split", upstream="host")
try:
    gpupool.ipc_open(bytes.fromhex(sys.argv[1]), 0)
    print("mapped another user's memory")
except gpupool.GpupoolError as e:
    assert e.status == 2, e
    assert "pass the descriptors yourself" in str(e), e
    assert gpupool.stats_json(0)["ipc_imports"] == 0
    print("refused:", e)
"""


def test_a_descriptor_fetched_by_another_user_is_refused_on_host(library):
    # A descriptor names the exporter's pid and file descriptor numbers; an importer of
    # another user may not take them out of the exporter (pidfd_getfd needs the right to
    # ptrace it), and the refusal says what to do instead. Needs root to start the importer
    # as another user.
    import os
    if os.geteuid() != 0:
        pytest.skip("needs root, to start an importer as another user")
    out = ok(run_py("""
        import ctypes, os, subprocess, sys, gpupool
        gpupool.configure(0, pool="arena", upstream="host")
        p = ctypes.c_void_p()
        assert gpupool.lib().gpupool_malloc(ctypes.byref(p), 3 << 20, 0, None) == 0
        desc = gpupool.ipc_export(p.value)
        # An interpreter the other user may run (this one may live in root's home).
        def runnable(c):
            try:
                return subprocess.run([c, "-c", "import gpupool"], user=65534, group=65534, capture_output=True,
                                      env=dict(os.environ, HOME="/tmp")).returncode == 0
            except OSError:
                return False
        py = next((c for c in (sys.executable, "/usr/bin/python3") if runnable(c)), None)
        if py is None:
            print("skip: no interpreter here that another user may run with gpupool importable")
            raise SystemExit(0)
        r = subprocess.run([py, "-c", os.environ["OTHER_USER_CHILD"], desc.hex()], user=65534, group=65534,
                           capture_output=True, text=True, env=dict(os.environ, HOME="/tmp"))
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.startswith("refused:"), r.stdout
        print(r.stdout.strip())
        print("ok")
    """, env={"OTHER_USER_CHILD": OTHER_USER_CHILD}))
    if out.startswith("skip:"):
        pytest.skip(out.strip()[6:])
    assert "ok" in out


def test_the_arena_chunk_threshold_is_read_from_the_environment_on_host(library):
    # A 16 MiB growth: eight granule allocations under the default threshold (64 MiB), two
    # chunks of 8 MiB with GPUPOOL_ARENA_CHUNK_FROM=8MiB; a malformed value is refused.
    script = """
        import ctypes, gpupool
        L = gpupool.lib()
        p = ctypes.c_void_p()
        assert L.gpupool_malloc(ctypes.byref(p), 16 << 20, 0, None) == 0
        j = gpupool.stats_json(0)
        assert j["strategy"] == "arena", j
        print("creates", j["driver_calls"]["mem_create"])
        assert L.gpupool_free(p, 0, None) == 0
    """
    assert "creates 8" in ok(run_py(script, env={"GPUPOOL_UPSTREAM": "host"}))
    assert "creates 2" in ok(run_py(script, env={"GPUPOOL_UPSTREAM": "host", "GPUPOOL_ARENA_CHUNK_FROM": "8MiB"}))
    out = ok(run_py("""
        import ctypes, gpupool
        p = ctypes.c_void_p()
        try:
            gpupool._check(gpupool.lib().gpupool_malloc(ctypes.byref(p), 16 << 20, 0, None))
            raise SystemExit("a malformed GPUPOOL_ARENA_CHUNK_FROM was accepted")
        except gpupool.GpupoolError as e:
            print(e)
    """, env={"GPUPOOL_UPSTREAM": "host", "GPUPOOL_ARENA_CHUNK_FROM": "eight"}))
    assert "GPUPOOL_ARENA_CHUNK_FROM" in out and "eight" in out, out


def test_one_version_everywhere_and_the_tool_says_it(library):
    # The package, the library and pyproject.toml name the same version.
    import re
    from conftest import ROOT
    want = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    out = ok(run_py("""
        import gpupool
        print("VERSIONS", gpupool.__version__, gpupool.lib().gpupool_version().decode())
    """))
    line = [l for l in out.splitlines() if l.startswith("VERSIONS")][0].split()
    assert line[1:] == [want, want], (line, want)
    p = run_py("import sys; from gpupool.__main__ import main; sys.argv = ['gpupool', '--version']; main()")
    assert p.returncode == 0 and f"gpupool {want}" in p.stdout, (p.stdout, p.stderr)


def test_an_integer_limit_out_of_range_is_refused_not_wrapped(library):
    out = ok(run_py("""
        import gpupool
        gpupool.configure(0, pool="arena", upstream="host")
        for bad in (-5, 1 << 64, 1 << 70):
            try:
                gpupool.set_limit(bad)
                raise SystemExit(f"{bad} accepted: limit now {gpupool.get_limit()}")
            except ValueError as e:
                assert str(bad) in str(e) and "2**64 - 1" in str(e), e
        try:
            gpupool.set_limit(1 << 40)  # over the host device's 16 GiB: caps nothing
            raise SystemExit("a limit above the device's memory was accepted")
        except gpupool.GpupoolError as e:
            assert "device 0: a limit of 1099511627776 bytes" in str(e) and "more than the device's memory" in str(e), e
        assert gpupool.get_limit() == 0
        gpupool.set_limit(1 << 30)
        assert gpupool.get_limit() == 1 << 30
        gpupool.set_limit(0)
        assert gpupool.get_limit() == 0
        print("ok")
    """))
    assert "ok" in out


def test_a_limit_setting_above_the_device_is_refused_naming_the_variable(library):
    out = ok(run_py("""
        import ctypes, gpupool
        p = ctypes.c_void_p()
        st = gpupool.lib().gpupool_malloc(ctypes.byref(p), 1 << 20, 0, None)
        assert st != 0 and not p.value, st
        err = gpupool._last_error()
        assert "GPUPOOL_MEMORY_LIMIT: a limit of" in err and "more than the device's memory" in err, err
        print("ok")
    """, env={"GPUPOOL_UPSTREAM": "host", "GPUPOOL_MEMORY_LIMIT": "4TiB"}))
    assert "ok" in out


def test_out_of_memory_reports_name_the_arenas_granule_and_its_address_space(library):
    # A request under a limit smaller than the arena's mapping unit: the report says the
    # arena maps whole granules. An arena whose reserved address space is full (a small
    # GPUPOOL_ARENA_VA) while the device has room: the hint names that setting.
    out = ok(run_py("""
        import ctypes, gpupool
        gpupool.configure(0, pool="arena", upstream="host")
        L = gpupool.lib()
        p = ctypes.c_void_p()
        gpupool.set_limit(1 << 20)
        assert L.gpupool_malloc(ctypes.byref(p), 512 << 10, 0, None) != 0
        msg = gpupool._last_error()
        assert "exceed the pool limit of 1.00 MiB" in msg and "whole granules of 2.00 MiB" in msg, msg
        print("ok limit")
    """))
    assert "ok limit" in out
    out = ok(run_py("""
        import ctypes, gpupool
        gpupool.configure(0, pool="arena", upstream="host")
        L = gpupool.lib()
        p = ctypes.c_void_p()
        for i in range(8):
            if L.gpupool_malloc(ctypes.byref(p), 3 << 20, 0, None) != 0:
                break
        else:
            raise SystemExit("the address space never filled")
        msg = gpupool._last_error()
        assert "address space" in msg and "GPUPOOL_ARENA_VA" in msg, msg
        print("ok va")
    """, env={"GPUPOOL_ARENA_VA": "8MiB"}))
    assert "ok va" in out


def _c_prototypes():
    """name -> (return type, [parameter types]) of every function the C headers declare."""
    import re
    from conftest import ROOT
    text = "".join(p.read_text() for p in sorted((ROOT / "include").glob("*.h")))
    text = re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)
    protos = {}
    for ret, name, params in re.findall(r"([A-Za-z_][\w \*]*?[\s\*])(gpupool_\w+)\s*\(([^;{]*?)\)\s*(?:GPUPOOL_DEPRECATED\([^)]*\)\s*)?;", text):
        ps = [" ".join(p.split()) for p in params.split(",") if p.strip() and p.strip() != "void"]
        protos[name] = (" ".join(ret.split()), ps)
    return protos


def _c_kind(decl):
    """The same for a C declaration (`const char *buf`, `size_t len`, `enum gpupool_status`)."""
    if "*" in decl:
        return "pointer"
    words = [w for w in decl.replace("const ", "").split()]
    base = " ".join(words[:2]) if words[0] == "enum" else words[0]
    return {"int": "int", "enum gpupool_status": "int", "size_t": "c_ulong", "uint32_t": "c_uint", "uint64_t": "c_ulong",
            "int64_t": "c_long", "double": "c_double", "void": "void", "bool": "c_bool"}.get(base, base)


def test_python_signatures_match_the_c_headers(library):
    """Every function Python declares through ctypes has the parameters and return type the
    library's header gives it (count, and scalar or pointer kind), and Python's stats struct
    has the header's fields: the library changes in one place, and this says where Python
    did not follow."""
    import ctypes
    out = ok(run_py("""
        import ctypes, json, gpupool
        L = gpupool.lib()
        def kind(t):
            if t is None:
                return "void"
            if t in (ctypes.c_void_p, ctypes.c_char_p) or issubclass(t, (ctypes._Pointer, ctypes._CFuncPtr)):
                return "pointer"
            return t.__name__
        sigs = {n: [kind(f.restype), [kind(a) for a in f.argtypes]] for n, f in vars(L).items()
                if n.startswith("gpupool_") and getattr(f, "argtypes", None) is not None}
        fields = [(n, ctypes.sizeof(t)) for n, t in gpupool.Stats._fields_]
        print(json.dumps({"sigs": sigs, "fields": fields}))
    """))
    import json
    got = json.loads(out.strip().splitlines()[-1])
    protos = _c_prototypes()
    assert len(got["sigs"]) >= 40, sorted(got["sigs"])
    c_int = "c_int"
    for name, (ret, args) in got["sigs"].items():
        assert name in protos, f"{name}: declared in Python, not in include/*.h"
        c_ret, c_params = protos[name]
        want = [c_int if _c_kind(p) == "int" else _c_kind(p) for p in c_params]
        assert len(args) == len(want), f"{name}: Python passes {len(args)} arguments, the header takes {len(want)}: {c_params}"
        for i, (a, w) in enumerate(zip(args, want)):
            assert a == w, f"{name}: argument {i} is {a} in Python, {c_params[i]!r} in the header"
        r = _c_kind(c_ret)
        assert ret == (c_int if r == "int" else r), f"{name}: returns {ret} in Python, {c_ret!r} in the header"
    import re
    from conftest import ROOT
    header = (ROOT / "include" / "gpupool.h").read_text()
    body = header[header.index("typedef struct gpupool_stats {"):header.index("} gpupool_stats;")]
    c_fields = re.findall(r"^\s*(uint32_t|uint64_t)\s+(\w+);", body, flags=re.M)
    assert [(n, 4 if t == "uint32_t" else 8) for t, n in c_fields] == [tuple(f) for f in got["fields"]]


def test_every_peer_enabled_at_once_is_what_later_pools_grant_on_host(library):
    # What PyTorch's plug-in route asks for (it has no peer-access hook): -1, -1 records
    # every peer of every device; a pool made later grants them with each grant.
    out = ok(run_py("""
        import ctypes, gpupool
        assert gpupool.enable_peer_access(-1, -1) == 0, "nothing was mapped yet"
        gpupool.configure(3, pool="arena", upstream="host")
        p = ctypes.c_void_p()
        assert gpupool.lib().gpupool_malloc(ctypes.byref(p), 5 << 20, 3, None) == 0
        calls = gpupool.stats_json(3)["driver_calls"]
        assert calls["set_access"] >= 1 and calls["peer_grants"] == 63 * calls["set_access"], calls
        for bad in ((3, 64), (-2, 0)):
            try:
                gpupool.enable_peer_access(*bad)
                raise SystemExit(f"enabled {bad}")
            except gpupool.GpupoolError as e:
                assert str(bad[0] if bad[0] < 0 else bad[1]) in str(e), e
        print("peers", calls["peer_grants"])
    """))
    assert out.startswith("peers")
