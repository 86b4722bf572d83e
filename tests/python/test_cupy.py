"""CuPy through gpupool, and CuPy + PyTorch sharing one pool (GPU; skipped without them)."""
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


def test_cupy_oom_raises_with_gpupool_message(cupy_gpu):
    out = ok(run_py("""
        import gpupool, cupy
        gpupool.cupy.install()
        gpupool.set_limit("256MiB", 0)
        try:
            x = cupy.empty(1 << 30, dtype=cupy.uint8)
            raise SystemExit("no exception: got an array at %#x" % x.data.ptr)
        except Exception as e:
            chain, c = [], e
            while c is not None:
                chain.append(f"{type(c).__name__}: {c}")
                c = c.__cause__ or c.__context__
            text = " | ".join(chain)
            assert "gpupool: out of memory on device 0" in text and "MemoryError" in text, text
            print("raised:", text[:300])
        y = cupy.ones(10)
        assert float(y.sum()) == 10.0
    """))
    assert "raised:" in out


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
