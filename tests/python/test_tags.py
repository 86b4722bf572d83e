"""Tags, pause and resume (docs/tags.md): the Python API on the host upstream (no GPU), and
on a GPU under PyTorch (gpupool's allocator class) and CuPy: memory given back to the
driver, contents bit-exact after resume, CUDA graphs captured before the pause replay, the
pause waits for queued work, and a trainer/rollout switch loop stays flat."""
import textwrap

from conftest import TORCH_ALLOCATOR, ok, run_py

TORCH = TORCH_ALLOCATOR


def test_tags_pause_and_resume_through_python_on_host(library):
    ok(run_py("""
        import ctypes, gpupool
        L = gpupool.lib()
        def malloc(n):
            p = ctypes.c_void_p()
            assert L.gpupool_malloc(ctypes.byref(p), n, 0, None) == 0, gpupool._last_error()
            return p.value
        with gpupool.tag("weights"):
            w = malloc(6 << 20)
            with gpupool.tag("kv"):
                kv = malloc(4 << 20)
        plain = malloc(1 << 20)
        ctypes.memset(w, 0x5a, 6 << 20)
        ctypes.memset(kv, 0x11, 4 << 20)
        tags = gpupool.stats_json(0)["tags"]
        assert set(tags) == {"weights", "kv"}, tags
        assert tags["weights"]["n_live_blocks"] == tags["kv"]["n_live_blocks"] == 1, tags
        released = gpupool.pause(["weights", "kv"], backup={"weights": True, "kv": False})
        assert released >= 10 << 20, released
        assert gpupool.paused_bytes("weights") >= 6 << 20
        assert gpupool.stats_json(0)["tags"]["kv"]["paused_bytes"] >= 4 << 20
        assert "paused" in gpupool.memory_status(0)
        with gpupool.tag("weights"):
            try:
                malloc(1 << 20)
                raise SystemExit("allocated under a paused tag")
            except AssertionError as e:
                assert "`weights`" in str(e) and "paused" in str(e), e
        for bad in ([""], ["never-named"]):
            try:
                gpupool.pause(bad)
                raise SystemExit(f"paused {bad}")
            except gpupool.GpupoolError as e:
                assert "tag" in str(e), e
        assert gpupool.resume(["weights", "kv"]) >= 10 << 20
        assert ctypes.string_at(w, 6 << 20) == b"\\x5a" * (6 << 20), "weights lost their contents"
        assert gpupool.paused_bytes("kv") == 0
        print("ok")
    """, env={"GPUPOOL_UPSTREAM": "host"}))


def test_a_bad_name_among_several_pauses_nothing_and_says_which_on_host(library):
    out = ok(run_py("""
        import ctypes, gpupool
        gpupool.configure(0, pool="arena", upstream="host")
        p = ctypes.c_void_p()
        with gpupool.tag("w"):
            assert gpupool.lib().gpupool_malloc(ctypes.byref(p), 3 << 20, 0, None) == 0
        try:
            gpupool.pause(["w", "nosuch"])
            raise SystemExit("paused with an unknown name")
        except gpupool.GpupoolError as e:
            assert '"nosuch"' in str(e) and "never named" in str(e), e
        assert gpupool.paused_bytes("w") == 0, "a refused call paused nothing"
        for bad, says in ((7, "not int"), (["w", 5], "is a str, not int")):
            try:
                gpupool.pause(bad)
                raise SystemExit(f"paused {bad!r}")
            except TypeError as e:
                assert says in str(e) and "gpupool.pause" in str(e), e
        assert gpupool.pause("w") > 0 and gpupool.resume(["w"]) > 0
        print("all or nothing")
    """))
    assert "all or nothing" in out


def test_a_tag_placed_as_cuda_ipc_refuses_a_pause_and_a_new_place_while_it_holds_memory_on_host(library):
    out = ok(run_py("""
        import ctypes, gpupool
        gpupool.configure(0, pool="arena", upstream="host")
        for args, error in (((5, "cuda-ipc"), TypeError), (("bucket", "cuda"), gpupool.GpupoolError)):
            try:
                gpupool.place_tag(*args)
                raise SystemExit(f"placed {args!r}")
            except error as e:
                assert "place_tag" in str(e) or "pausable | cuda-ipc" in str(e), e
        gpupool.place_tag("bucket", "cuda-ipc")
        p = ctypes.c_void_p()
        with gpupool.tag("bucket"):
            assert gpupool.lib().gpupool_malloc(ctypes.byref(p), 3 << 20, 0, None) == 0
        assert gpupool.stats_json(0)["tags"]["bucket"]["memory"] == "cuda-ipc"
        for call, says in ((lambda: gpupool.pause("bucket"), "cuda-ipc"), (lambda: gpupool.place_tag("bucket", "pausable"), "1 live")):
            try:
                call()
                raise SystemExit("a cuda-ipc tag holding memory paused or changed")
            except gpupool.GpupoolError as e:
                assert says in str(e), e
        assert gpupool.lib().gpupool_free(p, 0, None) == 0
        gpupool.place_tag("bucket", "pausable")
        with gpupool.tag("bucket"):
            assert gpupool.lib().gpupool_malloc(ctypes.byref(p), 3 << 20, 0, None) == 0
        assert gpupool.pause("bucket") > 0 and gpupool.resume("bucket") > 0
        print("placed")
    """))
    assert "placed" in out


def test_a_pause_naming_no_tags_pauses_every_pausable_tag_and_gives_the_cache_back_on_host(library):
    out = ok(run_py("""
        import ctypes, gpupool
        gpupool.configure(0, pool="arena", upstream="host")
        L = gpupool.lib()
        def malloc(n):
            p = ctypes.c_void_p()
            assert L.gpupool_malloc(ctypes.byref(p), n, 0, None) == 0, gpupool._last_error()
            return p.value
        gpupool.place_tag("sent", "cuda-ipc")
        with gpupool.tag("weights"):
            w = malloc(6 << 20)
        with gpupool.tag("kv"):
            kv = malloc(4 << 20)
        with gpupool.tag("sent"):
            sent = malloc(1 << 20)
        assert gpupool.named_tags() == {"weights": "pausable", "kv": "pausable", "sent": "cuda-ipc"}, gpupool.named_tags()
        cached = malloc(8 << 20)
        assert L.gpupool_free(cached, 0, None) == 0
        free = gpupool.stats_json(0)["device_free_bytes"]
        ctypes.memset(w, 0x5a, 6 << 20)
        released = gpupool.pause(backup={"kv": False})
        tagged = gpupool.paused_bytes("weights") + gpupool.paused_bytes("kv")
        assert gpupool.paused_bytes("weights") >= 6 << 20 and gpupool.paused_bytes("kv") >= 4 << 20
        assert gpupool.paused_bytes("sent") == 0, "a cuda-ipc tag is not paused"
        assert released >= tagged + (8 << 20), ("the cached 8 MiB went back too", released, tagged)
        assert gpupool.stats_json(0)["device_free_bytes"] - free == released, "the device got it all back"
        assert gpupool.resume() >= 10 << 20
        assert gpupool.paused_bytes("weights") == gpupool.paused_bytes("kv") == 0
        assert ctypes.string_at(w, 6 << 20) == b"\\x5a" * (6 << 20), "weights lost their contents"
        print("everything paused")
    """))
    assert "everything paused" in out


def test_pause_returns_the_memory_and_resume_restores_tensors_bit_exact(torch_gpu, library):
    out = ok(run_py(TORCH + textwrap.dedent("""
        torch.manual_seed(0)
        with gpupool.tag("weights"):
            ws = [torch.randn(n, device="cuda") for n in (1 << 28, 3 << 20, 12345, 1 << 26)]
        keep = [w.cpu() for w in ws]
        x = torch.randn(4096, device="cuda")
        torch.cuda.synchronize()
        mapped = gpupool.stats_json(0)["tags"]["weights"]["total_bytes"]
        free0, _ = torch.cuda.mem_get_info()
        released = gpupool.pause("weights")
        free1, _ = torch.cuda.mem_get_info()
        assert free1 - free0 >= 0.99 * mapped, (free0, free1, mapped, released)
        assert gpupool.stats_json(0)["tags"]["weights"]["paused_bytes"] > 0
        y = x * 2                                   # untagged work goes on
        with gpupool.tag("weights"):
            try:
                torch.empty(1 << 20, device="cuda")
                raise SystemExit("allocated under a paused tag")
            except RuntimeError as e:
                assert "paused" in str(e), e
        gpupool.resume("weights")
        for w, k in zip(ws, keep):
            assert torch.equal(w.cpu(), k), "a tensor changed across the pause"
        assert torch.equal(y, x * 2)
        print("returned", free1 - free0, "of", mapped)
    """)))
    assert "returned" in out


ENGINE = TORCH + textwrap.dedent("""
    import time
    # A serving engine in small: weights (backed up), a KV cache (not), decode graphs
    # captured for several batch sizes and a MemPool workspace, each made under a tag.
    torch.manual_seed(0)
    HIDDEN = 4096
    # The CUDA context with the engine's kernels and cuBLAS loaded and nothing allocated.
    w = torch.zeros(HIDDEN, 4 * HIDDEN, device="cuda", dtype=torch.bfloat16)
    for s in (torch.cuda.current_stream(), torch.cuda.Stream()):
        with torch.cuda.stream(s):
            for b in (1, 8, 32, 128):
                x = torch.zeros(b, HIDDEN, device="cuda", dtype=torch.bfloat16)
                (torch.relu(x @ w) @ w.t()).float().softmax(-1).sum()
    torch.cuda.synchronize()
    del w, x
    torch._C._cuda_clearCublasWorkspaces()
    gpupool.reclaim()
    free, total = torch.cuda.mem_get_info()
    context = total - free
    with gpupool.tag("weights"):
        w1 = torch.randn(HIDDEN, 4 * HIDDEN, device="cuda", dtype=torch.bfloat16) / 64
        w2 = torch.randn(4 * HIDDEN, HIDDEN, device="cuda", dtype=torch.bfloat16) / 64
        static_in = {b: torch.randn(b, HIDDEN, device="cuda", dtype=torch.bfloat16) for b in (1, 8, 32, 128)}
    with gpupool.tag("kv"):
        kv = torch.zeros(1 << 29, device="cuda", dtype=torch.bfloat16)          # 1 GiB
    with gpupool.tag("workspace"):
        ws_pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(ws_pool):
            ws = torch.ones(1 << 27, device="cuda")                             # 512 MiB
    def decode(x):
        h = torch.relu(x @ w1)
        return (h @ w2).float().softmax(-1) + ws[: HIDDEN].sum()
    graphs, outs = {}, {}
    with gpupool.tag("graphs"):
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for b in static_in:
                decode(static_in[b])                            # warm-up: cuBLAS's workspace
        torch.cuda.synchronize()
        for b in static_in:
            graphs[b] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[b]):
                outs[b] = decode(static_in[b])
    def run_all():
        for b in static_in:
            graphs[b].replay()
        torch.cuda.synchronize()
        return {b: outs[b].clone() for b in static_in}
    before = run_all()
    torch.cuda.synchronize()
    tags = gpupool.stats_json(0)["tags"]
    assert tags["graphs"]["n_live_blocks"] > 0, ("the graphs' memory is the tag's", tags)
    assert tags["workspace"]["n_live_blocks"] == 1, ("the MemPool's memory is the tag's", tags)
    allocated = torch.cuda.max_memory_allocated()
""")


def test_a_serving_engine_pauses_everything_and_its_graphs_replay_after_resume(torch_gpu, library):
    out = ok(run_py(ENGINE + textwrap.dedent("""
        held, mapped = [], []
        t0 = time.perf_counter()
        for cycle in range(100):
            gpupool.pause(backup={"kv": False, "graphs": False})
            free, _ = torch.cuda.mem_get_info()
            held.append(total - free - context)
            j = gpupool.stats_json(0)
            mapped.append(j["total_bytes"] - sum(t["paused_bytes"] for t in j["tags"].values()))
            gpupool.resume()
            if cycle in (0, 99):
                after = run_all()
                for b in static_in:
                    assert torch.equal(after[b], before[b]), f"batch {b}: the graph's output changed after a resume"
        dt = time.perf_counter() - t0
        worst = max(held)
        print(f"engine allocated {allocated >> 20} MiB; held while paused {min(held) >> 20}-{worst >> 20} MiB "
              f"({100 * worst / allocated:.2f} %) beyond the context's {context >> 20} MiB, of which gpupool maps "
              f"{max(mapped) >> 20} MiB; 100 pause/resume cycles in {dt:.1f} s", flush=True)
        assert max(mapped) <= 0.01 * allocated, ("gpupool keeps nothing mapped but 1 %", max(mapped), allocated)
        assert worst <= 0.01 * allocated, (worst, allocated)
        assert max(held) - min(held) <= 64 << 20, ("memory while paused stays flat", held[:3], held[-3:])
        print("engine slept")
    """)))
    assert "engine slept" in out


def test_a_pause_is_refused_while_a_capture_under_the_tag_is_in_progress(torch_gpu, library):
    out = ok(run_py(TORCH + textwrap.dedent("""
        x = torch.randn(1024, device="cuda")
        g = torch.cuda.CUDAGraph()
        with gpupool.tag("graphs"):
            with torch.cuda.graph(g):
                y = x * 2
                try:
                    gpupool.pause("graphs")
                    raise SystemExit("paused during a capture into the tag")
                except gpupool.GpupoolError as e:
                    assert "capture or MemPool" in str(e), e
        g.replay()
        assert torch.equal(y, x * 2)
        gpupool.pause("graphs", backup=False)
        gpupool.resume("graphs")
        x.fill_(3)
        g.replay()
        assert torch.equal(y, x * 2), "the graph replays into its resumed memory"
        held = gpupool.stats_json(0)["tags"]["graphs"]["total_bytes"]
        del g, y
        gpupool.reclaim()
        left = gpupool.stats_json(0)["tags"]["graphs"]["total_bytes"]
        assert left <= held - (32 << 20), ("a destroyed graph's memory went back", held, left)
        print("refused")
    """)))
    assert "refused" in out


def test_a_graph_captured_before_the_pause_replays_after_resume(torch_gpu, library):
    ok(run_py(TORCH + textwrap.dedent("""
        with gpupool.tag("weights"):
            w = torch.randn(2048, 2048, device="cuda")
        x = torch.randn(2048, 2048, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                y = x @ w
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = torch.relu(x @ w)
        g.replay()
        torch.cuda.synchronize()
        before = y.clone()
        gpupool.pause("weights")
        gpupool.resume("weights")
        y.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, before), "the graph's output changed"
        print("ok")
    """)))


def test_the_pause_waits_for_work_queued_on_the_stream(torch_gpu, library):
    ok(run_py(TORCH + textwrap.dedent("""
        with gpupool.tag("w"):
            a = torch.zeros(1 << 28, device="cuda")
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)              # the stream is busy for a while
        a.fill_(7)                                  # queued behind it
        gpupool.pause("w")                          # its copy waits for the fill
        gpupool.resume("w")
        assert bool((a == 7).all()), "the backup was taken before the queued fill"
        print("ok")
    """)))


def test_a_trainer_and_rollout_switch_loop_stays_flat(torch_gpu, library):
    out = ok(run_py(TORCH + textwrap.dedent("""
        torch.manual_seed(0)
        with gpupool.tag("trainer"):
            model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).cuda()
            opt = torch.optim.Adam(model.parameters())
            x = torch.randn(64, 2048, device="cuda")
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        with gpupool.tag("rollout"):
            kv = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        with torch.no_grad():
            want = model(x)
        torch.cuda.synchronize()
        free, calls = [], []
        for step in range(100):
            gpupool.pause("trainer")
            gpupool.resume("rollout")
            kv[:1024].fill_(step % 255)             # a KV cache: contents not kept
            gpupool.pause("rollout", backup=False)
            gpupool.resume("trainer")
            with torch.no_grad():
                assert torch.equal(model(x), want), step
            torch.cuda.synchronize()
            free.append(torch.cuda.mem_get_info()[0])
            d = gpupool.stats_json(0)["driver_calls"]
            calls.append(d["total"] - d["event_query"] - d["event_sync"])
        j = gpupool.stats_json(0)
        # Driver calls per switch: each cycle unmaps and maps the same allocations, so once
        # the pools are warm every cycle makes the same number of calls (growth is a leak of
        # work: a call that reaches no new peak). Event queries and waits are left out: how
        # many a wait takes depends on timing.
        per_cycle = [b - a for a, b in zip(calls[1:], calls[2:])]
        assert max(per_cycle) == min(per_cycle), ("driver calls per cycle vary", sorted(set(per_cycle)))
        # The device's free memory after each switch: flat (a few MiB of the driver's own
        # bookkeeping may move; a leak of the tags' memory would move it by their size).
        assert max(free[1:]) - min(free[1:]) <= 8 << 20, ("device memory moved", min(free[1:]), max(free[1:]))
        assert free[-1] >= free[1] - (8 << 20), (free[1], free[-1])
        print("steady", free[-1], "calls per cycle", per_cycle[-1], "trainer", j["tags"]["trainer"], "rollout", j["tags"]["rollout"])
    """)))
    assert "steady" in out
    print(out)


def test_cupy_arrays_under_a_tag_pause_and_resume(cupy_gpu, library):
    ok(run_py("""
        import gpupool, cupy
        gpupool.cupy.install()
        s = cupy.cuda.Stream(non_blocking=True)
        with gpupool.tag("cupy-weights"):
            a = cupy.arange(1 << 26, dtype=cupy.float32)
            with s:                                   # a user stream: the tag's too
                b = cupy.full(1 << 24, 3, dtype=cupy.int32)
        assert gpupool.stats_json(0)["tags"]["cupy-weights"]["n_live_blocks"] >= 2
        cupy.cuda.Device().synchronize()
        gpupool.pause("cupy-weights", stream=0)
        gpupool.resume("cupy-weights")
        assert bool((a == cupy.arange(1 << 26, dtype=cupy.float32)).all())
        assert bool((b == 3).all())
        print("ok")
    """))


def test_a_cupy_graph_captured_under_a_tag_pauses_with_it_and_replays(cupy_gpu, library):
    out = ok(run_py("""
        import gpupool, cupy
        gpupool.cupy.install()
        with gpupool.tag("cupy-graphs"):
            x = cupy.arange(1 << 22, dtype=cupy.float32)
            with gpupool.cupy.capture() as g:
                y = x * 2 + 1          # allocated during the capture: the tag's, in the graph's pool
                z = cupy.sqrt(y)
        cupy.cuda.Device().synchronize()
        assert gpupool.stats_json(0)["tags"]["cupy-graphs"]["n_live_blocks"] >= 3
        free0, _ = cupy.cuda.runtime.memGetInfo()
        gpupool.pause("cupy-graphs", stream=0)
        free1, _ = cupy.cuda.runtime.memGetInfo()
        assert free1 - free0 >= 48 << 20, ("the tag's and the graph's memory went back", free1 - free0)
        gpupool.resume("cupy-graphs")
        for i in range(3):
            x[:] = i
            g.launch()
            cupy.cuda.Device().synchronize()
            assert bool((z == cupy.sqrt(cupy.float32(2 * i + 1))).all()), i
        print("replayed", free1 - free0)
    """))
    assert "replayed" in out
