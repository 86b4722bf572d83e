"""The Python helper itself, on the host upstream (runs everywhere, CI included)."""
from conftest import ok, run_py


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


def test_missing_library_says_what_it_looked_for():
    p = run_py("import gpupool; gpupool.lib()", env={"GPUPOOL_LIBRARY": "/nonexistent/libgpupool.so"})
    assert p.returncode != 0
    assert "libgpupool.so not found" in p.stderr and "/nonexistent/libgpupool.so" in p.stderr, p.stderr
