"""PyTorch through gpupool (GPU; skipped without torch or a GPU)."""
from conftest import ok, run_py

MLP = """
    import os, torch
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator(device="cuda").manual_seed(1)
    losses = []
    for step in range(30):
        x = torch.randn(128, 256, device="cuda", generator=g)
        y = torch.randint(0, 10, (128,), device="cuda", generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        losses.append(loss.item())
    print("LOSSES", repr(losses))
"""
DET = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def losses(out):
    return [l for l in out.splitlines() if l.startswith("LOSSES")][0]


def test_mlp_training_matches_native_allocator(torch_gpu):
    native = ok(run_py(MLP, env=DET))
    pooled = ok(run_py("import gpupool; gpupool.torch.install()\n" + MLP.replace("\n    ", "\n"), env=DET))
    assert losses(native) == losses(pooled)


def test_mlp_training_on_page_mapped_memory_with_fast_decay_matches_native(torch_gpu):
    # vmm upstream, decay every 64 allocations: pages are decommitted and recommitted while
    # kernels run; the training must not notice.
    native = ok(run_py(MLP, env=DET))
    code = "import gpupool; gpupool.torch.install()\n" + MLP.replace("\n    ", "\n") + \
        "s = gpupool.stats(0); print('STATS', s['n_upstream_allocs'], s['reclaimed_bytes'])\n"
    pooled = ok(run_py(code, env=dict(DET, GPUPOOL_UPSTREAM="vmm", GPUPOOL_DECAY="64")))
    assert losses(native) == losses(pooled)
    print([l for l in pooled.splitlines() if l.startswith("STATS")])


def test_stats_answer_and_empty_cache_returns_memory_to_driver(torch_gpu):
    ok(run_py("""
        import gpupool, torch
        gpupool.torch.install()
        free0, _ = torch.cuda.mem_get_info()
        xs = [torch.empty(256 << 20, dtype=torch.uint8, device="cuda") for _ in range(4)]
        s = gpupool.stats(0)
        assert s["used_bytes"] >= 1 << 30 and s["n_live_blocks"] >= 4, s
        try:
            torch.cuda.memory_stats()
            print("torch.cuda.memory_stats answered under the plug-in")
        except Exception as e:
            print("torch.cuda.memory_stats raises under a plug-in:", type(e).__name__)
        del xs
        assert gpupool.stats(0)["free_bytes"] >= 1 << 30
        mid, _ = torch.cuda.mem_get_info()
        torch.cuda.empty_cache()
        free1, _ = torch.cuda.mem_get_info()
        s = gpupool.stats(0)
        assert s["n_reclaims"] >= 1 and s["total_bytes"] < 64 << 20, s
        assert free1 >= mid + (1 << 30) and free1 + (64 << 20) >= free0, (free0, mid, free1)
        print("ok")
    """))


def test_oom_raises_with_gpupool_message(torch_gpu):
    out = ok(run_py("""
        import gpupool, torch
        gpupool.torch.install()
        torch.cuda.set_per_process_memory_fraction(0.01)   # hook -> pool limit
        limit = gpupool.get_limit(0)
        assert 0 < limit < 2 << 30, limit
        try:
            x = torch.empty(8 << 30, dtype=torch.uint8, device="cuda")
            raise SystemExit("no exception: got a tensor at %#x" % x.data_ptr())
        except RuntimeError as e:
            msg = str(e)
            assert "gpupool: out of memory on device 0" in msg and "limit" in msg, msg
            print("raised:", msg.splitlines()[0][:200])
        y = torch.ones(1024, device="cuda")   # still usable afterwards
        assert y.sum().item() == 1024
        assert gpupool.stats(0)["n_ooms"] >= 1
    """))
    assert "raised: gpupool: out of memory" in out


def test_multistream_record_stream(torch_gpu):
    ok(run_py("""
        import gpupool, torch
        gpupool.torch.install()
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        results = []
        for i in range(50):
            with torch.cuda.stream(s1):
                x = torch.full((1 << 20,), float(i), device="cuda")
            s2.wait_stream(s1)
            with torch.cuda.stream(s2):
                torch.cuda._sleep(200000)
                y = x * 2
            x.record_stream(s2)
            del x
            with torch.cuda.stream(s1):
                z = torch.full((1 << 20,), -1.0, device="cuda")   # must not land in x's block while s2 reads it
            results.append((y, i))
        torch.cuda.synchronize()
        for y, i in results:
            assert torch.all(y == 2 * i).item(), i
        s = gpupool.stats(0)
        assert s["n_deferred_frees"] >= 50, s
        print("ok", s["n_deferred_frees"])
    """))


def test_mempool_mode(torch_gpu):
    ok(run_py("""
        import gpupool, torch
        pool = gpupool.torch.mempool()
        with torch.cuda.use_mem_pool(pool):
            a = torch.randn(1 << 20, device="cuda")
            b = a * 3
        s = gpupool.stats(0)
        assert s["n_allocs"] >= 1 and s["used_bytes"] >= 4 << 20, s   # segments came from gpupool
        c = torch.randn(10, device="cuda")                          # outside: PyTorch's own allocator
        assert torch.allclose(b, a * 3)
        print("ok", s["n_allocs"], s["used_bytes"])
    """))


def test_foreign_free_is_counted_not_fatal(torch_gpu):
    p = run_py("""
        import ctypes, gpupool
        L = gpupool.lib()
        gpupool.configure(0, upstream="device")
        f = L.gpupool_torch_free
        f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        for _ in range(3):
            f(0x7000_0000, 64, 0, None)
        assert gpupool.stats(0)["n_invalid_frees"] == 3
        print("alive")
    """)
    assert "alive" in ok(p)
    assert p.stderr.count("not allocated by gpupool") == 1, p.stderr
