"""PyTorch through gpupool (GPU; skipped without torch or a GPU)."""
import pytest
from conftest import ok, run_py, with_batch_rule

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
# The plug-in route, where gpupool's own reductions send CUDA tensors between processes.
PLUGIN = {"GPUPOOL_TORCH_ALLOCATOR": "0"}


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


# Fill the pool up to its limit (1% of the device) in 64 MiB tensors until out of memory,
# free one, allocate again; gpupool's counters must follow each step exactly. {typed}: the
# exception is torch.OutOfMemoryError (gpupool's allocator class) or a plain RuntimeError
# (the plug-in route).
OOM_SCENARIO = with_batch_rule("""
    import gpupool, torch
    gpupool.torch.install()
    assert (gpupool.torch.route() == "allocator") == {typed}, gpupool.torch.route()
    torch.cuda.set_per_process_memory_fraction(0.01)   # hook -> pool limit
    limit = gpupool.get_limit(0)
    assert 0 < limit < 2 << 30, limit
    chunk = 64 << 20
    before = gpupool.stats(0)
    xs, err = [], None
    try:
        for _ in range(1000):
            xs.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
        raise SystemExit("no out-of-memory error within 1000 chunks")
    except RuntimeError as e:
        err = e
    assert isinstance(err, torch.OutOfMemoryError) == {typed}, type(err)
    assert isinstance(err, torch.cuda.OutOfMemoryError) == {typed}, type(err)
    try:          # `except torch.OutOfMemoryError`, the spelling users write, on the typed path
        torch.empty(8 << 30, dtype=torch.uint8, device="cuda")
        raise SystemExit("no exception for 8 GiB")
    except (torch.OutOfMemoryError if {typed} else RuntimeError) as e:
        assert isinstance(e, torch.OutOfMemoryError) == {typed}, type(e)
    msg = str(err)
    assert "gpupool: out of memory on device 0" in msg and "limit" in msg, msg
    # PyTorch's phrase first: accelerate's and Lightning's batch-size finders retry smaller.
    assert msg.startswith("CUDA out of memory. gpupool: out of memory"), msg
    assert should_reduce_batch_size(err), repr(err)
    s = gpupool.stats(0)
    assert len(xs) >= 1 and s["n_ooms"] == before["n_ooms"] + 2, (len(xs), before, s)
    assert s["used_bytes"] == before["used_bytes"] + len(xs) * chunk, (len(xs), before, s)
    assert s["n_live_blocks"] == before["n_live_blocks"] + len(xs), (len(xs), before, s)
    del xs[-1]
    y = torch.empty(chunk, dtype=torch.uint8, device="cuda")   # the freed block serves it
    s2 = gpupool.stats(0)
    keys = ("n_ooms", "used_bytes", "n_live_blocks", "n_upstream_allocs")
    assert [s2[k] for k in keys] == [s[k] for k in keys], (s, s2)
    y.fill_(7)
    assert int(y[-1].item()) == 7
    del xs, y
    torch.cuda.synchronize()
    s3 = gpupool.stats(0)
    assert (s3["used_bytes"], s3["n_live_blocks"]) == (before["used_bytes"], before["n_live_blocks"]), (before, s3)
    assert s3["n_ooms"] == before["n_ooms"] + 2, s3
    print("raised:", type(err).__name__, msg.splitlines()[0][:200])
""")


def test_oom_raises_torch_out_of_memory_error_and_recovers(torch_gpu):
    p = run_py(OOM_SCENARIO.format(typed=True))
    out = ok(p)
    assert "raised: OutOfMemoryError CUDA out of memory. gpupool: out of memory" in out, out
    assert "plug-in class" not in p.stderr, p.stderr   # no fallback warning


def test_oom_on_the_plugin_route_is_a_runtime_error_with_gpupool_message(torch_gpu, tmp_path):
    # GPUPOOL_TORCH_ALLOCATOR=0: the library's own allocation function, nothing compiled
    # (an empty extension folder stays empty), no warning.
    p = run_py(OOM_SCENARIO.format(typed=False), env={"GPUPOOL_TORCH_ALLOCATOR": "0", "TORCH_EXTENSIONS_DIR": str(tmp_path)})
    out = ok(p)
    assert "raised: RuntimeError CUDA out of memory. gpupool: out of memory" in out, out
    assert "gpupool:" not in p.stderr, p.stderr
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())


def test_allocator_is_compiled_once_with_a_notice_and_then_needs_no_compiler(torch_gpu, tmp_path):
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path)}
    first = run_py(OOM_SCENARIO.format(typed=True), env=env)
    assert "raised: OutOfMemoryError" in ok(first)
    assert first.stderr.count("gpupool: compiling its PyTorch allocator once") == 1, first.stderr
    # Cached: loaded without compiling, so neither the notice nor a compiler is needed.
    second = run_py(OOM_SCENARIO.format(typed=True), env=dict(env, CXX="/nonexistent/c++"))
    assert "raised: OutOfMemoryError" in ok(second)
    assert "gpupool:" not in second.stderr, second.stderr


def test_allocator_that_cannot_be_built_falls_back_with_one_warning(torch_gpu, tmp_path):
    # No compiler (CXX names none) and an empty extension cache: the class cannot be built.
    # The plug-in route then answers PyTorch's memory statistics from gpupool's.
    p = run_py(with_batch_rule("""
        import warnings, gpupool, torch
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            gpupool.torch.install()
            gpupool.torch._install_class(None)   # tried once per process: no second warning
        ws = [str(x.message) for x in w if "gpupool" in str(x.message)]
        assert len(ws) == 1, ws
        assert "plug-in class, not as a full allocator" in ws[0] and "no C++ compiler" in ws[0], ws[0]
        assert "cuDNN benchmark mode" in ws[0] and "GPUPOOL_TORCH_ALLOCATOR=0" in ws[0], ws[0]
        assert gpupool.torch.route() == "plugin"
        try:
            gpupool.torch._install_class(True)   # asked for explicitly: an error, not a fallback
            raise SystemExit("compiled=True fell back")
        except RuntimeError as e:
            assert "compiled=True" in str(e) and "no C++ compiler" in str(e), e
        x = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
        s = gpupool.stats(0)
        assert torch.cuda.memory_allocated() == s["used_bytes"] > 0, (torch.cuda.memory_allocated(), s)
        assert torch.cuda.memory_reserved() == s["total_bytes"], s
        assert torch.cuda.max_memory_allocated() >= torch.cuda.memory_allocated()
        del x
        torch.cuda.reset_peak_memory_stats()
        assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated() == gpupool.stats(0)["used_bytes"]
        assert "Memory summary" in torch.cuda.memory_summary() or "PyTorch CUDA memory summary" in torch.cuda.memory_summary()
        torch.cuda.set_per_process_memory_fraction(0.01)
        try:
            torch.empty(8 << 30, dtype=torch.uint8, device="cuda")
            raise SystemExit("no exception")
        except RuntimeError as e:
            assert not isinstance(e, torch.OutOfMemoryError), type(e)
            assert "gpupool: out of memory on device 0" in str(e), e
            assert should_reduce_batch_size(e), repr(e)
        assert gpupool.stats(0)["n_ooms"] == 1
        assert torch.ones(1024, device="cuda").sum().item() == 1024
        print("fell back")
    """), env={"TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": "/nonexistent/c++"})
    assert "fell back" in ok(p)


def test_malformed_allocator_switch_is_an_error(torch_gpu):
    p = run_py("import gpupool; gpupool.torch.install()", env={"GPUPOOL_TORCH_ALLOCATOR": "maybe"})
    assert p.returncode != 0
    assert 'invalid value "maybe" for GPUPOOL_TORCH_ALLOCATOR; accepted: 0 | 1' in p.stderr, p.stderr


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


@pytest.mark.parametrize("pool", ["split", "arena"])
def test_cuda_tensors_go_through_torch_multiprocessing(torch_gpu, pool):
    # bench/frameworks/share_check.py: mixed sizes and dtypes, views beside their bases, the consumer
    # checks and adds 1, the producer sees it; a block the consumer holds is not reused;
    # letting go frees it; nothing live or imported at the end in either process.
    import json
    from conftest import ROOT, run_script
    # gpupool's own reductions: the plug-in route (the allocator class sends through
    # PyTorch's, test_torch_allocator.py).
    p = run_script(ROOT / "bench" / "frameworks" / "share_check.py", ["--allocator", pool, "--tensors", "300", "--max-mib", "16"],
                   env=PLUGIN, timeout=600)
    r = json.loads(ok(p).strip().splitlines()[-1])
    assert r["consumer_bad"] == 0 and r["producer_sees_change_bad"] == 0, r
    assert r["reused_while_held"] == 0, r
    before, held = r["live_blocks_while_held"]
    assert held >= 300 and held == before, r          # the producer's own references went; the blocks stayed
    assert r["held_after_release"] == 0 and r["live_blocks_after_release"] == 0, r
    held_there = r["consumer_while_held"]
    assert held_there["imports"] >= 1, r
    if pool == "arena":  # a receiver reserves what it maps, rounded to granules, not a multiple of the device
        assert 0 < held_there["import_address_space"] <= 2 * r["bytes_in_granules"], r
    assert r["consumer_after_release"]["imports"] == 0, r
    assert r["consumer_end"]["live_blocks"] == 0 and r["consumer_exit"] == 0, r
    assert "exiting while other processes still hold" not in p.stderr, p.stderr


ORDERED_SENDS = """
import sys
import torch
import torch.multiprocessing as mp


def _same(t):
    return t


class Later:
    # Pickled after the message's first tensor: its reduction queues a long kernel, then
    # the tensor it sends (`base + 1`), so only the event's record at the message's end
    # (or one at its own send) covers it.

    def __init__(self, base):
        self.base = base

    def __reduce__(self):
        torch.cuda._sleep(1 << 30)
        return (_same, (self.base + 1,))


def consume(q, out, wait):
    import gpupool.torch
    gpupool.torch.install()
    if not wait:  # `nowait`: shows that without the waits this script fails
        gpupool.torch._wait_event = lambda device, handle: None
    torch.zeros(1, device="cuda")
    out.put("ready")
    for _ in range(3):
        got = q.get()
        # Read at once, on this process's stream: only the sender's event orders the read
        # after the sender's writes, which wait behind a long kernel.
        out.put([(t.min().item(), t.max().item()) for t in got])
        del got


if __name__ == "__main__":
    import os
    os.environ["GPUPOOL_POOL"] = sys.argv[1]
    import gpupool.torch
    gpupool.torch.install()
    ctx = mp.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=consume, args=(q, out, sys.argv[2:] != ["nowait"]), daemon=True)
    child.start()
    assert out.get(timeout=120) == "ready"
    # Each message is ordered after its own writes. (The first may pass without any wait:
    # the receiver's first mapping can outlast the kernel; the later ones cannot.)
    for message in range(3):
        ts = [torch.zeros(n, device="cuda") for n in (1 << 8, 1 << 18, 3 << 20, 1 << 12)]
        ts.append(ts[1][5:])  # a view, sent beside its base
        torch.cuda.synchronize()
        torch.cuda._sleep(1 << 30)  # about half a second of GPU time before the writes
        for i, t in enumerate(ts[:4]):
            t.fill_(10 * message + i + 1)
        q.put(ts + [Later(ts[1])])  # the last one's work is queued while the message is pickled
        got = out.get(timeout=120)
        want = [10 * message + i + 1 for i in range(4)] + [10 * message + 2, 10 * message + 3]
        assert got == [(v, v) for v in want], (message, got, want)
    torch.cuda.synchronize()
    print("ordered")
"""


@pytest.mark.parametrize("pool", ["split", "arena"])
def test_a_message_of_cuda_tensors_is_read_after_the_senders_queued_writes(torch_gpu, pool, tmp_path):
    # Every tensor of a message, on any pool: the consumer's stream waits for the sender's
    # event before the first read, and for work a reducer queued while the message was
    # pickled (the sends of one message share one event, recorded at the first of them and
    # again once the message is pickled).
    from conftest import run_script
    script = tmp_path / "ordered_sends.py"
    script.write_text(ORDERED_SENDS)
    assert "ordered" in ok(run_script(script, [pool], env=PLUGIN, timeout=300))


FROM_NATIVE = """
import gc
import sys
import time
import torch
import torch.multiprocessing as mp


def consume(q, out, pool, routed):
    import os
    os.environ["GPUPOOL_POOL"] = pool
    import gpupool
    import gpupool.torch
    from torch.multiprocessing import reductions
    pytorchs = reductions.rebuild_cuda_tensor
    gpupool.torch.install()
    if not routed:  # `unrouted`: PyTorch's own receiving function, which shows this script can fail
        reductions.rebuild_cuda_tensor = pytorchs
    torch.zeros(1, device="cuda")
    out.put("ready")
    base, view, other, param, again = q.get()
    checks = {
        "base": (base[0].item(), base[-1].item()),  # the sender's +1 was queued behind a long kernel
        "view_shares": view.data_ptr() == base.data_ptr() + 100 * 4 and torch.equal(view, base[100:200]),
        "again_shares": again.data_ptr() == base.data_ptr(),
        "other": (other.min().item(), other.max().item()),
        "param": (type(param).__name__, param.requires_grad, param.sum().item()),
        "imports": gpupool.stats_json(0).get("ipc_imports"),
    }
    base.mul_(2)
    other.fill_(9)
    torch.cuda.synchronize()
    out.put(checks)
    # Sent again after a write queued behind a long kernel: open here already, read at once.
    (later,) = q.get()
    out.put((later.data_ptr() == base.data_ptr(), later[0].item(), gpupool.stats_json(0).get("ipc_imports")))
    del later
    assert q.get() == "release"
    del base, view, other, param, again
    gc.collect()
    out.put(gpupool.stats_json(0).get("ipc_imports"))


if __name__ == "__main__":
    # The sender does not use gpupool: PyTorch's own CUDA IPC route.
    ctx = mp.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=consume, args=(q, out, sys.argv[1], sys.argv[2:] != ["unrouted"]), daemon=True)
    child.start()
    assert out.get(timeout=120) == "ready"
    base = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    other = torch.full((3 << 20,), 7, device="cuda", dtype=torch.uint8)
    param = torch.nn.Parameter(torch.ones(10, device="cuda"))
    torch.cuda.synchronize()
    torch.cuda._sleep(1 << 30)  # about half a second of GPU time before the write
    base.add_(1)
    q.put([base, base[100:200], other, param, base])
    got = out.get(timeout=120)
    assert got["base"] == (1.0, float(1 << 20)), got
    assert got["view_shares"] and got["again_shares"], got
    assert got["other"] == (7, 7) and got["param"] == ("Parameter", True, 10.0), got
    assert got["imports"] == 3, got  # one per storage: the views and the second send share base's
    torch.cuda.synchronize()
    assert base[0].item() == 2.0 and base[-1].item() == float(2 << 20), "the consumer's write is here"
    assert other.min().item() == 9 and other.max().item() == 9
    torch.cuda._sleep(1 << 30)
    base.add_(1)
    q.put([base])
    assert out.get(timeout=120) == (True, 3.0, 3), "the second send waits for the sender's event too"
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    del base, other, param
    torch.cuda.ipc_collect()
    assert torch.cuda.memory_allocated() == held, "kept while the consumer holds it"
    q.put("release")
    assert out.get(timeout=120) == 0, "the consumer closed every mapping"
    for _ in range(100):
        torch.cuda.ipc_collect()
        if torch.cuda.memory_allocated() < held - (7 << 20):
            break
        time.sleep(0.05)
    assert torch.cuda.memory_allocated() < held - (7 << 20), (torch.cuda.memory_allocated(), held)
    child.join(60)
    assert child.exitcode == 0, child.exitcode
    print("received")
"""


@pytest.mark.parametrize("pool", ["split", "arena"])
def test_cuda_tensors_from_a_process_without_gpupool_are_received(torch_gpu, pool, tmp_path):
    # PyTorch's own route from a sender on its own allocator: after install() the receiver
    # opens the sender's CUDA IPC handles through gpupool (CUDAPluggableAllocator refuses
    # them for every plug-in), waits for the sender's event, shares one mapping between
    # views and repeated sends, writes land in the sender's memory, and the sender frees
    # the memory only once the receiver let go (PyTorch's reference count, given back).
    from conftest import run_script
    script = tmp_path / "from_native.py"
    script.write_text(FROM_NATIVE)
    assert "received" in ok(run_script(script, [pool], env=PLUGIN, timeout=300))


TO_PLAIN = """
import gc
import sys
import torch
import torch.multiprocessing as mp


def consume(q, out):
    # No gpupool.torch.install() here: PyTorch's own allocator; the sends name gpupool's
    # rebuild function, which maps them through the library.
    torch.zeros(1, device="cuda")
    out.put("ready")
    base, view, small = q.get()
    checks = (base[0].item(), base[-1].item(), view.data_ptr() == base.data_ptr() + 4 * 100, small.sum().item())
    base.mul_(2)
    torch.cuda.synchronize()
    out.put(checks)
    assert q.get() == "release"
    del base, view, small
    gc.collect()
    import gpupool
    out.put(gpupool.stats_json(0).get("ipc_imports"))


if __name__ == "__main__":
    import os
    os.environ["GPUPOOL_POOL"] = sys.argv[1]
    import gpupool
    import gpupool.torch
    gpupool.torch.install()
    ctx = mp.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=consume, args=(q, out), daemon=True)
    child.start()
    assert out.get(timeout=120) == "ready"
    base = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    small = torch.ones(16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(1 << 30)
    base.add_(1)
    q.put([base, base[100:], small])
    got = out.get(timeout=120)
    assert got == (1.0, float(1 << 20), True, 16.0), got
    torch.cuda.synchronize()
    assert base[0].item() == 2.0, "the receiver's write is here"
    live = gpupool.stats_json(0)["n_live_blocks"]
    del base, small
    gc.collect()
    torch.cuda.ipc_collect()
    assert gpupool.stats_json(0)["n_live_blocks"] == live, "kept while the receiver holds them"
    q.put("release")
    assert out.get(timeout=120) == 0, "the receiver closed every mapping"
    import time
    for _ in range(100):
        torch.cuda.ipc_collect()
        if gpupool.stats_json(0)["n_live_blocks"] <= live - 2:
            break
        time.sleep(0.05)
    assert gpupool.stats_json(0)["n_live_blocks"] <= live - 2, (gpupool.stats_json(0)["n_live_blocks"], live)
    child.join(60)
    assert child.exitcode == 0, child.exitcode
    print("received")
"""


@pytest.mark.parametrize("pool", ["split", "arena"])
def test_cuda_tensors_reach_a_process_that_did_not_install_gpupool(torch_gpu, pool, tmp_path):
    # The other way: a receiver on PyTorch's own allocator (gpupool importable, not
    # installed) maps gpupool's sends through the library, reads the sender's writes after
    # its event, writes back, and the sender frees the blocks only once it let go.
    from conftest import run_script
    script = tmp_path / "to_plain.py"
    script.write_text(TO_PLAIN)
    assert "received" in ok(run_script(script, [pool], env=PLUGIN, timeout=300))
