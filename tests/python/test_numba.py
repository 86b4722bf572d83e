"""Numba through gpupool's external memory manager (GPU; skipped without numba-cuda and a GPU)."""
import pytest
from conftest import ok, run_py


def _need_numba_gpu():
    p = run_py("from numba import cuda; import sys; sys.exit(0 if cuda.is_available() else 3)")
    if p.returncode != 0:
        pytest.skip("numba-cuda with a GPU is not available here: " + (p.stderr.strip().splitlines() or ["?"])[-1])


def test_numba_device_arrays_live_in_gpupool_and_keep_their_data():
    """Numba's allocations, copies and views on gpupool memory (no kernel compiled)."""
    _need_numba_gpu()
    out = ok(run_py("""
        import numpy as np
        from numba import cuda
        import gpupool

        n = 1 << 20
        host = np.arange(n, dtype=np.float32)
        x = cuda.to_device(host)
        y = cuda.device_array(n, dtype=np.float32)
        y.copy_to_device(x)                          # device to device
        assert np.array_equal(y.copy_to_host(), host)
        assert np.array_equal(y[1000:2000].copy_to_host(), host[1000:2000])   # a view
        s = gpupool.stats(0)
        assert s["n_allocs"] >= 2 and s["used_bytes"] >= 2 * n * 4, s
        info = cuda.current_context().get_memory_info()
        assert info.total > 0 and 0 < info.free <= info.total, info
        used = s["used_bytes"]
        del x, y
        cuda.current_context().deallocations.clear()  # Numba's deferred frees run now
        assert gpupool.stats(0)["used_bytes"] <= used - 2 * n * 4, gpupool.stats(0)
        print("ok", s["n_allocs"])
    """, env={"NUMBA_CUDA_MEMORY_MANAGER": "gpupool.numba"}))
    assert out.startswith("ok")


def test_numba_kernel_on_gpupool_memory():
    _need_numba_gpu()
    # Whether this Numba can compile a kernel at all, without gpupool. numba-cuda (0.30.4 and
    # older) registers `np.row_stack` for NumPy >= 2, a name NumPy 2.5 removed: then alias it
    # to `np.vstack` (what it was) before Numba loads, so the kernel can still be compiled.
    shims = ["", "import numpy as np\nif not hasattr(np, 'row_stack'):\n    np.row_stack = np.vstack\n"]
    probe = None
    for shim in shims:
        probe = run_py(shim + """
import numpy as np
from numba import cuda
@cuda.jit
def k(a):
    a[0] = 1
a = cuda.device_array(1, dtype=np.float32)
k[1, 1](a)
assert a.copy_to_host()[0] == 1
""")
        if probe.returncode == 0:
            break
    if probe.returncode != 0:
        pytest.skip("this Numba cannot compile kernels, with or without gpupool: "
                    + (probe.stderr.strip().splitlines() or ["?"])[-1])
    out = ok(run_py(shim + """
import numpy as np
from numba import cuda
import gpupool

@cuda.jit
def axpy(a, x, y, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = a * x[i] + y[i]

n = 1 << 20
x = cuda.to_device(np.arange(n, dtype=np.float32))
y = cuda.to_device(np.ones(n, dtype=np.float32))
out = cuda.device_array(n, dtype=np.float32)
axpy[(n + 255) // 256, 256](2.0, x, y, out)
got = out.copy_to_host()
assert np.array_equal(got, 2 * np.arange(n, dtype=np.float32) + 1)
s = gpupool.stats(0)
assert s["n_allocs"] >= 3 and s["used_bytes"] >= 3 * n * 4, s
print("ok", s["n_allocs"])
""", env={"NUMBA_CUDA_MEMORY_MANAGER": "gpupool.numba"}))
    assert out.startswith("ok")


def test_gpupool_numba_without_numba_says_what_is_missing():
    p = run_py("import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('numba') is None else 5)")
    if p.returncode == 5:
        pytest.skip("numba is installed here")
    bad = run_py("import gpupool.numba")
    assert bad.returncode != 0 and "needs Numba's CUDA target" in bad.stderr, bad.stderr
