"""CUDA graphs and streams with gpupool installed (GPU; skipped without torch / cupy and a GPU).

PyTorch captures in global mode by default: any driver call the pool made that a capture
forbids would end the capture with cudaErrorStreamCaptureInvalidated and fail these tests.
"""
from conftest import CUPY_SPIN_FILL, need, ok, run_py

MODEL = """
    import gc, gpupool, torch
    gpupool.torch.install()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512)).cuda()
    def private_pools():
        return [l for l in gpupool.memory_status(0).splitlines() if "Private pools" in l]
"""


def test_torch_cuda_graph_replays_equal_eager_and_its_pool_is_released(torch_gpu):
    out = ok(run_py(MODEL + """
    static_x = torch.randn(64, 512, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():      # warm-up, as PyTorch's docs ask
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    # Captured on the warmed-up stream: cuBLAS keeps one workspace per stream, allocated at
    # its first use there; made during a capture it would come from the graph's pool and stay
    # live (so the pool too) for the process, as with PyTorch's own allocator.
    with torch.no_grad(), torch.cuda.graph(g, stream=s):
        static_y = model(static_x)
    assert private_pools(), gpupool.memory_status(0)
    graph_ptr = static_y.data_ptr()
    for i in range(5):
        x = torch.randn(64, 512, device="cuda")
        static_x.copy_(x)
        g.replay()
        eager = torch.empty(64 * 512, device="cuda")   # must not be the graph's memory
        eager.fill_(float("nan"))
        with torch.no_grad():
            want = model(x)
        torch.cuda.synchronize()
        assert eager.data_ptr() != graph_ptr
        assert torch.equal(static_y, want), (i, (static_y - want).abs().max().item())
    reserved = gpupool.stats(0)["total_bytes"]
    del g, static_y, eager
    gc.collect()
    torch.cuda.synchronize()
    assert not private_pools(), gpupool.memory_status(0)
    print("ok", reserved, gpupool.stats(0)["total_bytes"])
    """))
    assert out.startswith("ok")


def test_make_graphed_callables_matches_eager_forward_and_backward(torch_gpu):
    ok(run_py(MODEL + """
    import copy
    ref = copy.deepcopy(model)
    x = torch.randn(32, 512, device="cuda", requires_grad=True)
    graphed = torch.cuda.make_graphed_callables(model, (x,))
    for i in range(4):
        xi = torch.randn(32, 512, device="cuda", requires_grad=True)
        xr = xi.detach().clone().requires_grad_(True)
        y = graphed(xi); y.sum().backward()
        yr = ref(xr); yr.sum().backward()
        torch.cuda.synchronize()
        assert torch.allclose(y, yr, atol=1e-6), (i, (y - yr).abs().max().item())
        assert torch.allclose(xi.grad, xr.grad, atol=1e-6)
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.allclose(p.grad, q.grad, atol=1e-5), (p.grad - q.grad).abs().max().item()
            p.grad = None; q.grad = None
    print("ok")
    """))


def test_torch_compile_reduce_overhead_matches_eager(torch_gpu):
    out = ok(run_py(MODEL + """
    import torch._inductor.config as ic
    assert ic.triton.cudagraph_trees is False, "install() routes compile's graphs through torch.cuda.graph"
    compiled = torch.compile(model, mode="reduce-overhead")
    with torch.no_grad():
        for i in range(6):
            x = torch.randn(64, 512, device="cuda")
            y = compiled(x).clone()
            want = model(x)
            torch.cuda.synchronize()
            assert torch.allclose(y, want, atol=1e-5, rtol=1e-4), (i, (y - want).abs().max().item())
    print("ok", private_pools())
    """, timeout=600))
    assert out.startswith("ok")


def test_torch_mempool_scope_keeps_its_memory_private(torch_gpu):
    p = run_py("""
        import gpupool, torch
        gpupool.torch.install()
        try:
            pool = torch.cuda.MemPool()
        except RuntimeError as e:
            print("UNSUPPORTED", str(e).splitlines()[0]); raise SystemExit(0)
        with torch.cuda.use_mem_pool(pool):
            a = torch.full((1 << 20,), 2.0, device="cuda")
        pa = a.data_ptr()
        del a
        b = torch.empty(1 << 20, device="cuda")       # eager: not the pool's freed block
        assert b.data_ptr() != pa
        print("ok")
    """)
    out = ok(p)
    if "UNSUPPORTED" in out:
        import pytest
        pytest.skip("PyTorch refuses MemPool() with a plug-in allocator: " + out.strip())


CUPY_STREAMS = """
    import gpupool, cupy, threading
    gpupool.cupy.install()
""" + CUPY_SPIN_FILL + """    n = 1 << 18
    runs, threads = @RUNS@, @THREADS@
    bad = [0] * threads
    def worker(t):
        kinds = [lambda: cupy.cuda.Stream(non_blocking=True), lambda: cupy.cuda.Stream(non_blocking=True),
                 lambda: cupy.cuda.Stream.ptds, lambda: cupy.cuda.Stream(non_blocking=True)]
        for r in range(runs // threads):
            s1 = kinds[r % 4]()
            s2 = cupy.cuda.Stream(non_blocking=True)
            with s1:
                x = cupy.empty(n, dtype=cupy.uint32)
                spin(((n + 255) // 256,), (256,), (x, cupy.uint64(n), cupy.uint32(t + 1), cupy.int64(400_000)))
                keep = x[::1024].copy()
            del x                                   # freed while the slow kernel may still run
            with s2:
                y = cupy.zeros(n, dtype=cupy.uint32)  # another non-blocking stream
            s1.synchronize(); s2.synchronize()
            bad[t] += int((keep != t + 1).sum()) + int((y != 0).sum())
            del y, keep
    ts = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    [t.start() for t in ts]; [t.join() for t in ts]
    print("RUNS", runs, "CORRUPTED", sum(bad))
"""


def test_cupy_non_blocking_streams_never_corrupt_and_the_test_catches_an_unsafe_pool(cupy_gpu):
    safe = ok(run_py(CUPY_STREAMS.replace("@RUNS@", "1000").replace("@THREADS@", "4"), timeout=600))
    assert "RUNS 1000 CORRUPTED 0" in safe, safe
    unsafe = ok(run_py(CUPY_STREAMS.replace("@RUNS@", "200").replace("@THREADS@", "4"),
                       env={"GPUPOOL_UNSAFE_IGNORE_STREAMS": "1"}))
    assert "CORRUPTED 0" not in unsafe, "the stress did not catch a pool that ignores streams: " + unsafe


def test_raw_cupy_route_on_non_blocking_streams_never_corrupts(cupy_gpu):
    # The two C symbols installed by hand, as the design's CuPy route reads (no
    # gpupool.cupy.install(), so no stream getter registered): the library finds CuPy's
    # current stream itself, and the same stress stays clean.
    raw = CUPY_STREAMS.replace("    gpupool.cupy.install()\n", """    import ctypes
    _L = gpupool.lib()
    _addr = lambda name: ctypes.cast(getattr(_L, name), ctypes.c_void_p).value
    cupy.cuda.set_allocator(cupy.cuda.memory.CFunctionAllocator(
        0, _addr("gpupool_cupy_malloc"), _addr("gpupool_cupy_free"), _L).malloc)
""")
    assert "install()" not in raw
    out = ok(run_py(raw.replace("@RUNS@", "1000").replace("@THREADS@", "4"), timeout=600))
    assert "RUNS 1000 CORRUPTED 0" in out, out


def test_cupy_arrays_outliving_their_destroyed_stream_free_safely(cupy_gpu):
    """A CuPy array freed after its stream was destroyed: the free must not name the dead
    stream to the driver (recording an event there crashes inside it), and its memory must
    still be reused."""
    out = ok(run_py("""
        import gc, gpupool, cupy
        gpupool.cupy.install()
        keep = []
        for i in range(50):
            s = cupy.cuda.Stream(non_blocking=True)
            with s:
                a = cupy.full(1 << 18, i, dtype=cupy.float32)   # 1 MiB, booked on s
                b = a * 2
            s.synchronize()
            keep.append((i, b))
            del a, s                  # the stream goes (cudaStreamDestroy); b outlives it
            gc.collect()
        for i, b in keep:
            assert float(b[-1]) == 2 * i, i
        del keep, b
        gc.collect()                  # every free names a destroyed stream's booking
        # Their memory is not proven idle without a device-wide wait, which the pool makes
        # only under pressure: with the limit at what it holds, it must still serve.
        before = gpupool.stats(0)["n_upstream_allocs"]
        gpupool.set_limit(gpupool.stats(0)["total_bytes"], 0)
        c = [cupy.ones(1 << 18, dtype=cupy.float32) for _ in range(40)]
        cupy.cuda.Device().synchronize()
        after = gpupool.stats(0)["n_upstream_allocs"]
        assert after == before, ("the dead streams' memory was not reused", before, after)
        print("ok", before, after)
    """))
    assert out.startswith("ok")


def test_cupy_graph_capture_replays_correctly(cupy_gpu):
    ok(run_py("""
        import gpupool, cupy
        gpupool.cupy.install()
        x = cupy.arange(1 << 20, dtype=cupy.float32)
        with gpupool.cupy.capture() as g:
            y = x * 2 + 1          # allocated during the capture: kept for the graph
            z = cupy.sqrt(y)
        assert "Private pools" in gpupool.memory_status(0), gpupool.memory_status(0)
        for i in range(3):
            x[:] = i
            g.launch()
            cupy.cuda.Device().synchronize()
            assert bool((z == cupy.sqrt(cupy.float32(2 * i + 1))).all()), i
        # A raw capture nobody announced works too (its memory stays for the graph).
        s = cupy.cuda.Stream(non_blocking=True)
        with s:
            s.begin_capture()
            w = x + 5
            graph = s.end_capture()
            x[:] = 1
            graph.launch()
        s.synchronize()
        assert bool((w == 6).all())
        print("ok")
    """))


def test_cupy_pinned_allocator_comes_from_gpupool(cupy_gpu):
    ok(run_py("""
        import ctypes, gpupool, cupy, numpy as np
        gpupool.cupy.install()
        a = cupy.arange(1 << 20, dtype=cupy.float32)
        host = cupy.cuda.alloc_pinned_memory(a.nbytes)
        h = np.frombuffer(host, np.float32, a.size)
        a.get(out=h)
        assert h[12345] == 12345.0
        s = gpupool.Stats(); s.struct_size = ctypes.sizeof(s)
        assert gpupool.lib().gpupool_pinned_get_stats(ctypes.byref(s)) == 0
        assert s.n_allocs >= 1, "pinned memory came from gpupool's pinned pool"
        print("ok", s.n_allocs)
    """))
