"""What gpupool's allocator class sends, opened by receivers as deployments run them (GPU):
a process that never imports gpupool (a rollout engine on PyTorch's own allocator), through
a `torch.multiprocessing` queue and through `reduce_tensor` / `rebuild_cuda_tensor` called
directly (vLLM's and SGLang's weight updates); and both ends inside a container-like
seccomp filter (`no_ptrace.py`: `kcmp` and `pidfd_getfd` refused), where gpupool receivers
must still open everything and a receiver on PyTorch's allocator opens what PyTorch's own
would (CUDA IPC handles; expandable segments need `pidfd_getfd`)."""
import pathlib
import sys

import pytest

from conftest import ok, run_script

HERE = pathlib.Path(__file__).parent

SENDER = r'''
import contextlib, os, sys, time
import torch
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import reduce_tensor


def receive(inq, outq, route, gpupool_receiver):
    # Runs in a spawned process: this module's top level imports no gpupool.
    try:
        if gpupool_receiver:
            import gpupool
            gpupool.torch.install(compiled=True)
        torch.cuda.init()
        while True:
            msg = inq.get()
            if msg == "stop":
                outq.put(("stopped", None, None, None))
                return
            ts = [fn(*args) for fn, args in msg] if route == "reduce" else msg
            sums = [float(t.double().sum()) for t in ts]
            for t in ts:
                t.add_(1)
            torch.cuda.synchronize()
            outq.put(("ok", sums, "gpupool" in sys.modules, None))
            del ts, msg
    except Exception as e:
        outq.put(("error", repr(e), "gpupool" in sys.modules, None))


def kind(t):
    h = t.untyped_storage()._share_cuda_()[1]
    return "gpupool-only" if h.startswith(b"gpupool-ipc1") else chr(h[1]) if len(h) > 64 else "bare"


if __name__ == "__main__":
    route, receiver = sys.argv[1], sys.argv[2]
    sender = sys.argv[3] if len(sys.argv) > 3 else "gpupool"
    if sender.startswith("gpupool"):
        import gpupool
        gpupool.torch.install(compiled=True)
        assert gpupool.torch.route() == "allocator", gpupool.torch.route()
    ctx = mp.get_context("spawn")
    inq, outq = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=receive, args=(inq, outq, route, receiver == "gpupool"))
    p.start()
    torch.manual_seed(0)
    # gpupool-cuda-ipc: what is sent lies under a tag placed as cuda-ipc (docs/tags.md).
    if sender == "gpupool-cuda-ipc":
        gpupool.place_tag("bucket", "cuda-ipc")
    where = gpupool.tag("bucket") if sender == "gpupool-cuda-ipc" else contextlib.nullcontext()
    with where:
        # 4 KB to 200 MB of float32, and a view that starts 16 KB into its storage.
        ts = [(torch.arange(n, device="cuda", dtype=torch.float32) % 97) for n in (1000, 300_000, 5_000_000, 50_000_000)]
        base = torch.randint(0, 50, (1 << 20,), device="cuda").float()
        ts.append(base[4096:])
    if sender == "gpupool-cuda-ipc":
        assert gpupool.stats_json(0)["tags"]["bucket"]["memory"] == "cuda-ipc"
    print("formats", [kind(t) for t in ts], flush=True)
    for rnd in range(3):
        before = [t.clone() for t in ts]
        expected = [float(t.double().sum()) for t in ts]
        msg = [reduce_tensor(t) for t in ts] if route == "reduce" else ts
        inq.put(msg)
        del msg
        status, sums, imported, _ = outq.get(timeout=180)
        assert status == "ok", sums
        assert imported == (receiver == "gpupool"), ("receiver imported gpupool", imported)
        assert sums == expected, (sums, expected)
        torch.cuda.synchronize()
        for t, b in zip(ts, before):
            assert torch.equal(t, b + 1), "the receiver's writes are the sender's memory"
    inq.put("stop")
    assert outq.get(timeout=60)[0] == "stopped"
    p.join(60)
    assert p.exitcode == 0, p.exitcode
    print("received", route, receiver, os.environ.get("GPUPOOL_POOL", "arena"), "from", sender, flush=True)
'''


def _run(tmp_path, route, receiver, pool, confined, sender="gpupool"):
    script = tmp_path / "sender.py"
    script.write_text(SENDER)
    args = [str(script), route, receiver, sender]
    if confined:
        return run_script(HERE / "no_ptrace.py", [sys.executable, *args], env={"GPUPOOL_POOL": pool}, timeout=600)
    return run_script(script, args[1:], env={"GPUPOOL_POOL": pool}, timeout=600)


@pytest.mark.parametrize("expandable", [False, True])
def test_a_gpupool_receiver_opens_what_pytorchs_own_allocator_sends(torch_gpu, library, tmp_path, expandable):
    script = tmp_path / "sender.py"
    script.write_text(SENDER)
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} if expandable else {}
    out = ok(run_script(script, ["queue", "gpupool", "stock"], env=env, timeout=600))
    assert "received queue gpupool arena from stock" in out, out
    assert ("'e'" in out.split("formats", 1)[1].splitlines()[0]) == expandable, out


@pytest.mark.parametrize("route", ["queue", "reduce"])
@pytest.mark.parametrize("pool", ["arena", "split"])
def test_a_receiver_on_pytorchs_own_allocator_opens_what_gpupool_sends(torch_gpu, library, tmp_path, route, pool):
    out = ok(_run(tmp_path, route, "stock", pool, confined=False))
    assert f"received {route} stock {pool}" in out, out


@pytest.mark.parametrize("pool", ["arena", "split"])
def test_gpupool_to_gpupool_works_where_pidfd_getfd_and_kcmp_are_refused(torch_gpu, library, tmp_path, pool):
    out = ok(_run(tmp_path, "queue", "gpupool", pool, confined=True))
    assert f"received queue gpupool {pool}" in out, out


def test_a_stock_receiver_in_a_container_opens_cuda_ipc_handles(torch_gpu, library, tmp_path):
    out = ok(_run(tmp_path, "reduce", "stock", "split", confined=True))
    assert "received reduce stock split" in out, out


@pytest.mark.parametrize("route", ["queue", "reduce"])
def test_a_stock_receiver_in_a_container_opens_a_tag_placed_as_cuda_ipc(torch_gpu, library, tmp_path, route):
    # The arena stays the device's pool; only the tag's memory is cudaMalloc segments.
    out = ok(_run(tmp_path, route, "stock", "arena", confined=True, sender="gpupool-cuda-ipc"))
    assert f"received {route} stock arena from gpupool-cuda-ipc" in out, out
    assert "formats ['c', 'c', 'c', 'c', 'c']" in out, out


def test_a_stock_receiver_in_a_container_fails_on_arena_memory_as_on_expandable_segments(torch_gpu, library, tmp_path):
    # PyTorch's receiver copies an expandable segment's descriptors with pidfd_getfd, which
    # the filter refuses: its own error, as for PyTorch's own expandable segments there.
    p = _run(tmp_path, "reduce", "stock", "arena", confined=True)
    assert p.returncode != 0 and "pidfd_getfd" in p.stdout + p.stderr, (p.stdout, p.stderr)


SLEEP = r'''
import sys
import torch
import torch.multiprocessing as mp


def receive(inq, outq, gpupool_receiver):
    if gpupool_receiver:
        import gpupool
        gpupool.torch.install(compiled=True)
    torch.cuda.init()
    held = None
    while True:
        msg = inq.get()
        if msg == "stop":
            return
        if msg == "kept":
            # What this process keeps mapped of other processes' memory.
            j = __import__("gpupool").stats_json(0)
            outq.put((j["ipc_imports_kept"], j["ipc_import_address_space"]))
            continue
        if msg == "drop":
            # The rollout engine lets go of the weights it kept.
            held = None
            import gc
            gc.collect()
            torch.cuda.synchronize()
            outq.put("dropped")
            continue
        if isinstance(msg, tuple) and msg[0] == "hold":
            held = msg[1]   # kept mapped: the sender's pause must refuse
            outq.put(__import__("os").getpid())
            continue
        copies = [t.clone() for t in msg]   # the rollout engine's copy of the weights
        torch.cuda.synchronize()
        sums = [float(c.double().sum()) for c in copies]
        del msg
        outq.put(sums)


if __name__ == "__main__":
    receiver, cycles = sys.argv[1], int(sys.argv[2])
    assert cycles >= 3, "the baseline is taken at the third cycle"
    import gpupool
    gpupool.torch.install(compiled=True)
    ctx = mp.get_context("spawn")
    inq, outq = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=receive, args=(inq, outq, receiver == "gpupool"))
    p.start()
    with gpupool.tag("weights"):
        ws = [torch.full((n,), 0.0, device="cuda") for n in (1000, 3_000_000, 40_000_000)]
    free_seen = []
    for cycle in range(cycles):
        for i, w in enumerate(ws):
            w.fill_(float(cycle * 3 + i))
        expected = [float(w.double().sum()) for w in ws]
        if cycle == 2:
            # Paused with nothing sent since the last pause: what the device has free.
            # Taken after two sends: by then each process's own memory has reached what a
            # cycle needs (the receiver's second copy is made while its first is alive,
            # which its pool keeps cached after), so that later cycles compare with it.
            gpupool.pause("weights")
            free_unsent = torch.cuda.mem_get_info()[0]
            gpupool.resume("weights")
        inq.put(ws)
        assert outq.get(timeout=120) == expected, cycle
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()
        released = gpupool.pause("weights")
        assert released > 0, released
        free_seen.append(torch.cuda.mem_get_info()[0])
        if receiver == "gpupool":
            # The pause asked the receiver for the memory it kept mapped between messages,
            # and returned once it was dropped (a receiver that kept it would hold the old
            # allocation alive, and the device would get nothing back).
            inq.put("kept")
            assert outq.get(timeout=120) == (0, 0), ("kept mappings after the pause", cycle)
        gpupool.resume("weights")
        for i, w in enumerate(ws):
            assert float(w.double().sum()) == expected[i], ("contents after resume", cycle)
    if receiver == "gpupool":
        # A receiver that keeps the weights mapped: the pause refuses, naming the receiving
        # process, and pauses nothing; once it lets go, the pause goes through.
        inq.put(("hold", ws))
        holder = outq.get(timeout=120)
        torch.cuda.synchronize()
        try:
            gpupool.pause("weights")
            raise AssertionError("a pause while the receiver maps the weights went through")
        except gpupool.GpupoolError as e:
            assert f"process {holder}" in str(e) and "let go" in str(e), str(e)
        assert gpupool.paused_bytes("weights") == 0
        inq.put("drop")
        assert outq.get(timeout=120) == "dropped"
        torch.cuda.ipc_collect()
        assert gpupool.pause("weights") > 0
        gpupool.resume("weights")
        print("pause refused while held", flush=True)
    inq.put("stop")
    p.join(60)
    assert p.exitcode == 0, p.exitcode
    # Paused, the device's free memory is the same each cycle once the first is done (a
    # receiver that kept the old memory alive would lower it cycle after cycle).
    spread = max(free_seen[1:]) - min(free_seen[1:])
    print("sleep after send", receiver, cycles, "free spread MiB", spread >> 20,
          "below unsent MiB", (free_unsent - min(free_seen[2:])) >> 20, flush=True)
    assert spread <= 64 << 20, free_seen
    if receiver == "gpupool":
        # Each pause got the weights' memory back from the receiver too: the device has as
        # much free as when nothing had been sent since the last pause.
        assert min(free_seen[2:]) >= free_unsent - (64 << 20), (free_unsent, free_seen)
'''


@pytest.mark.parametrize("receiver", ["gpupool", "stock"])
def test_send_receiver_copies_pause_resume_send_again(torch_gpu, library, tmp_path, receiver):
    script = tmp_path / "sleep.py"
    script.write_text(SLEEP)
    out = ok(run_script(script, [receiver, "100"], timeout=600))
    assert f"sleep after send {receiver} 100" in out, out
    if receiver == "gpupool":
        assert "pause refused while held" in out, out
