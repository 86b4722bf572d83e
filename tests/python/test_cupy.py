"""CuPy through gpupool, and CuPy + PyTorch sharing one pool (GPU; skipped without them)."""
import pytest
from conftest import CUPY_SPIN_FILL, need, ok, run_py


def test_cupy_math_is_correct(cupy_gpu):
    ok(run_py("""
        import gpupool, cupy, numpy as np
        gpupool.cupy.install()
        rng = np.random.default_rng(0)
        a, b = rng.standard_normal((512, 256)), rng.standard_normal((256, 128))
        assert np.allclose(cupy.asnumpy(cupy.asarray(a) @ cupy.asarray(b)), a @ b)
        x = rng.standard_normal(4096)
        assert np.allclose(cupy.asnumpy(cupy.fft.fft(cupy.asarray(x))), np.fft.fft(x))
        assert np.isclose(float(cupy.asarray(x).sum()), x.sum()) and np.isclose(float(cupy.asarray(x).max()), x.max())
        assert gpupool.stats(0)["n_allocs"] > 0
        print("ok")
    """))


# Fill the pool up to a 256 MiB limit in 64 MiB arrays until out of memory, free one, allocate
# again; gpupool's counters must follow each step exactly. `mode`: "default" (install(): the C
# path), "typed" (install(typed_oom=True)) or "python" (python_allocator(), the path typed_oom
# takes where CuPy does not pass the C path's error on; tested on any CuPy).
CUPY_OOM = """
    import pickle, gpupool, cupy
    mode = MODE
    if mode == "python":
        cupy.cuda.set_allocator(gpupool.cupy.python_allocator().malloc)
    else:
        gpupool.cupy.install(typed_oom=(mode == "typed"))
    # Whether this CuPy passes a Python error from a CFunctionAllocator's malloc on (the
    # cupy-cuda13x 14.2.0 wheel did not, 2026-11-23): if not, the C path ends in SystemError.
    passes_on = gpupool.cupy.c_allocator_raises_typed()
    print("CuPy", cupy.__version__, "C path passes errors on:", passes_on)
    typed = passes_on or mode != "default"
    gpupool.set_limit("256MiB", 0)
    chunk = 64 << 20
    before = gpupool.stats(0)
    xs, err = [], None
    try:
        for _ in range(100):
            xs.append(cupy.empty(chunk, dtype=cupy.uint8))
        raise SystemExit("no out-of-memory error within 100 chunks")
    except cupy.cuda.memory.OutOfMemoryError as e:
        err = e
    except SystemError as e:   # the C path where CuPy does not pass errors on: ours is the cause
        assert not typed, repr(e)
        err = e.__cause__
    assert type(err) is gpupool.cupy.OutOfMemoryError, type(err)
    assert isinstance(err, cupy.cuda.memory.OutOfMemoryError) and isinstance(err, MemoryError), type(err).__mro__
    msg = str(err)
    assert msg.startswith("CUDA out of memory. gpupool: out of memory on device 0") and "limit" in msg, msg
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is type(err) and str(again) == msg
    s = gpupool.stats(0)
    assert len(xs) >= 1 and s["n_ooms"] == before["n_ooms"] + 1, (len(xs), before, s)
    assert s["used_bytes"] == before["used_bytes"] + len(xs) * chunk, (len(xs), before, s)
    assert s["n_live_blocks"] == before["n_live_blocks"] + len(xs), (len(xs), before, s)
    del xs[-1]
    y = cupy.empty(chunk, dtype=cupy.uint8)      # the freed block serves it
    s2 = gpupool.stats(0)
    keys = ("n_ooms", "used_bytes", "n_live_blocks", "n_upstream_allocs")
    assert [s2[k] for k in keys] == [s[k] for k in keys], (s, s2)
    y.fill(7)
    assert int(y[-1]) == 7
    del xs, y
    cupy.cuda.Device().synchronize()
    s3 = gpupool.stats(0)
    assert (s3["used_bytes"], s3["n_live_blocks"]) == (before["used_bytes"], before["n_live_blocks"]), (before, s3)
    print("raised:", type(err).__name__, "typed" if typed else "in SystemError", msg.splitlines()[0][:200])
"""


@pytest.mark.parametrize("mode", ["default", "typed", "python"])
def test_cupy_oom_raises_cupy_out_of_memory_error_and_recovers(cupy_gpu, mode):
    out = ok(run_py(CUPY_OOM.replace("MODE", repr(mode))))
    assert "raised: OutOfMemoryError" in out, out
    if mode != "default":
        assert "raised: OutOfMemoryError typed" in out, out


STREAMS = """
    import gpupool, cupy
    gpupool.cupy.install()
""" + CUPY_SPIN_FILL + """    n = 1 << 20
    s1, s2 = cupy.cuda.Stream(), cupy.cuda.Stream()     # blocking streams, CuPy's default kind
    bad = 0
    for r in range(40):
        with s1:
            x = cupy.empty(n, dtype=cupy.uint32)
            spin(((n + 255) // 256,), (256,), (x, cupy.uint64(n), cupy.uint32(1), cupy.int64(3_000_000)))
            keep = x[::4096].copy()   # x's contents as s1 sees them after the slow write
        del x                          # freed while the slow kernel may still run
        with s2:
            y = cupy.zeros(n, dtype=cupy.uint32)   # likely the same block
        cupy.cuda.Device().synchronize()
        bad += int((keep != 1).sum()) + int((y != 0).sum())
        del y, keep
    print("CORRUPTED", bad)
"""


def test_cupy_non_default_streams_are_safe_and_the_test_catches_an_unsafe_pool(cupy_gpu):
    safe = ok(run_py(STREAMS))
    assert "CORRUPTED 0" in safe, safe
    unsafe = ok(run_py(STREAMS, env={"GPUPOOL_UNSAFE_IGNORE_STREAMS": "1"}))
    assert "CORRUPTED 0" not in unsafe, "the test did not catch a pool without the CuPy fence: " + unsafe


def test_torch_and_cupy_share_one_pool_and_dlpack(cupy_gpu):
    need("torch")
    ok(run_py("""
        import gpupool, torch, cupy
        gpupool.torch.install()
        gpupool.cupy.install()
        t = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        del t
        torch.cuda.synchronize()
        before = gpupool.stats(0)["n_upstream_allocs"]
        c = cupy.empty(64 << 20, dtype=cupy.uint8)          # served from what PyTorch freed
        after = gpupool.stats(0)["n_upstream_allocs"]
        assert after == before, (before, after)
        # DLPack both ways
        a = torch.arange(1000, device="cuda", dtype=torch.float32)
        ca = cupy.from_dlpack(a)
        assert float(ca.sum()) == float(a.sum().item())
        b = torch.from_dlpack(cupy.arange(10, dtype=cupy.float32) * 2)
        assert b.sum().item() == 90.0
        print("ok", before, after)
    """))


def test_cupy_arena_array_shared_with_another_process(cupy_gpu):
    # cudaIpcGetMemHandle refuses the arena's memory; gpupool's own IPC shares it: a second
    # interpreter maps the array, checks it, doubles it in place; this one sees the result.
    out = ok(run_py("""
        import subprocess, sys, textwrap, gpupool, cupy
        gpupool.configure(0, pool="arena")
        gpupool.cupy.install()
        n = 3 * 1024 * 1024 + 5
        a = cupy.arange(n, dtype=cupy.float32)
        cupy.cuda.runtime.deviceSynchronize()
        try:
            cupy.cuda.runtime.ipcGetMemHandle(a.data.ptr)
            print("cudaIpcGetMemHandle: accepted")
        except cupy.cuda.runtime.CUDARuntimeError as e:
            print("cudaIpcGetMemHandle:", e)
        desc = gpupool.ipc_export(a.data.ptr)
        fds = gpupool.ipc_descriptor_fds(desc)
        child = textwrap.dedent('''
            import sys, gpupool, cupy
            desc, n = bytes.fromhex(sys.argv[1]), int(sys.argv[2])
            p = gpupool.ipc_open(desc, 0, fds=gpupool.ipc_descriptor_fds(desc))
            mem = cupy.cuda.UnownedMemory(p, n * 4, None)
            b = cupy.ndarray((n,), cupy.float32, cupy.cuda.MemoryPointer(mem, 0))
            assert bool((b == cupy.arange(n, dtype=cupy.float32)).all()), "child reads other values"
            b *= 2
            cupy.cuda.runtime.deviceSynchronize()
            del b, mem
            gpupool.ipc_close(p, 0)
            print("child ok")
        ''')
        r = subprocess.run([sys.executable, "-c", child, desc.hex(), str(n)], pass_fds=fds, capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
        print(r.stdout.strip())
        assert bool((a == 2 * cupy.arange(n, dtype=cupy.float32)).all()), "the child's writes are not seen"
        print("granules:", len(fds), "ok")
    """))
    assert "child ok" in out, out


CUPY_SHARE_CHILD = """
import os

def consume(pool, inq, outq):
    os.environ["GPUPOOL_POOL"] = pool
    import cupy, gpupool.cupy
    gpupool.cupy.install()
    arrays = inq.get()
    ok = all(bool((a == cupy.arange(a.size, dtype=a.dtype).reshape(a.shape) % 97).all()) for a in arrays)
    for a in arrays[1:]:  # arrays[0] is a view of arrays[1]
        a *= 2
    cupy.cuda.get_current_stream().synchronize()
    same = arrays[0].data.ptr == arrays[1].data.ptr
    outq.put((ok, same))
    assert inq.get() == "release"
    del arrays, a
    import gc
    gc.collect()
    outq.put(gpupool.stats_json(0)["ipc_imports"])
"""


@pytest.mark.parametrize("pool", ["split", "arena"])
def test_an_array_is_shared_with_a_child_and_back(cupy_gpu, pool, tmp_path):
    (tmp_path / "cupy_share_child.py").write_text(CUPY_SHARE_CHILD)
    out = ok(run_py(f"""
        import multiprocessing, os, sys
        os.environ["GPUPOOL_POOL"] = "{pool}"
        sys.path.insert(0, {str(tmp_path)!r})
        import cupy, gpupool, gpupool.cupy, cupy_share_child
        gpupool.cupy.install()
        base = cupy.arange(1 << 20, dtype=cupy.float32) % 97
        small = cupy.arange(64, dtype=cupy.int32) % 97
        view = base[:4096]
        ctx = multiprocessing.get_context("spawn")
        inq, outq = ctx.Queue(), ctx.Queue()
        child = ctx.Process(target=cupy_share_child.consume, args=("{pool}", inq, outq), daemon=True)
        child.start()
        inq.put([gpupool.cupy.share(view), gpupool.cupy.share(base), gpupool.cupy.share(small)])
        checked, same = outq.get(timeout=120)
        assert checked, "the child read other values"
        assert same, "two arrays over one block share one mapping in the child"
        assert bool((base == 2 * (cupy.arange(1 << 20, dtype=cupy.float32) % 97)).all()), "the child's writes are not here"
        assert bool((small == 2 * (cupy.arange(64, dtype=cupy.int32) % 97)).all())
        # The view and its base are one block: the child mapped it once and let the second
        # send go at once.
        assert gpupool.share.collect() == 2, "held while the child holds"
        inq.put("release")
        assert outq.get(timeout=120) == 0, "the child closed its mappings"
        child.join(60)
        assert child.exitcode == 0
        assert gpupool.share.collect() == 0
        if "{pool}" == "arena":
            try:
                cupy.cuda.runtime.ipcGetMemHandle(base.data.ptr)
                raise SystemExit("cudaIpcGetMemHandle accepted arena memory")
            except cupy.cuda.runtime.CUDARuntimeError as e:
                assert "gpupool.cupy.share" in str(e), e
        print("ok")
    """, timeout=300))
    assert "ok" in out
