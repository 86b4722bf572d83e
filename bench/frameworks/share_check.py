#!/usr/bin/env python3
"""CUDA tensors through a torch.multiprocessing queue, producer to consumer and back, under
one allocator: `native` (PyTorch's), or gpupool's `split` / `arena` (gpupool.torch.install()
in both processes). The consumer checks every tensor and adds 1 in place; the producer
checks the change. Under gpupool it also checks that a block the consumer still holds is
not reused by the producer (its storage kept alive: new tensors land elsewhere, the live
block count stays), that letting go frees it (`torch.cuda.ipc_collect()`), and that both
processes end with no live block and nothing imported. Prints one JSON line last:
tensors/s through the queue (consumer start-up excluded), the consumer's time unpickling
(`consumer_loads_s`: rebuilding the tensors, which opens or imports their memory) and the checks.

    python3 bench/frameworks/share_check.py --allocator arena --tensors 1000 [--profile DIR] [--check-parts] [--warm-consumer]

--profile DIR: the producer's pickling (where it exports) and the consumer's receiving and
checking are profiled (cProfile) over the measured exchange; the functions by cumulative
time go to DIR/{producer,consumer}-ALLOCATOR.txt, and each handover's fetch in the consumer
(ms, in order) to DIR/consumer-fetch-ms-ALLOCATOR.txt.

--check-parts: the consumer synchronises around each part of its check and reports them
apart: making the expected pattern (`consumer_pattern_s`: its own allocations and kernels),
comparing (`consumer_equal_s`: kernels reading the received memory) and the in-place adds
(`consumer_add_s`). Slower overall; for attributing `consumer_check_s`.
--check-after-all: the consumer unpickles every message before it checks any (the producer
has sent everything by then), so no check runs beside the producer's sending.
--warm-consumer: before the exchange the consumer makes (and drops) every expected pattern
once, so its own allocator has grown to what the checks need before the clock starts.
--pickle-first: the producer pickles every message (the exports, the sends' events) before
the clock starts and then puts the pickled bytes on the queue, so nothing the producer does
for a send runs beside the consumer's checks; the consumer's unpickling is then the two
`loads` (the bytes, then the message).
"""
import argparse
import cProfile
import io
import json
import math
import os
import pstats
import random
import time


def write_profile(prof, path):
    """The top of `prof` by cumulative time, to `path`."""
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(45)
    with open(path, "w") as f:
        f.write(out.getvalue())

DTYPES = ["float32", "bfloat16", "uint8", "int64"]


def items(n, seed, max_bytes):
    """(dtype, element count, view start) of each tensor: sizes log-uniform 256 B to max_bytes;
    every 7th is sent as a view (from element 3 on) beside its base."""
    import torch
    rng = random.Random(seed)
    out = []
    for i in range(n):
        dt = getattr(torch, DTYPES[i % len(DTYPES)])
        nbytes = int(math.exp(rng.uniform(math.log(256), math.log(max_bytes))))
        elems = max(8, nbytes // torch.empty((), dtype=dt).element_size())
        out.append((dt, elems, 3 if i % 7 == 0 else None))
    return out


def pattern(i, elems, dtype, device):
    import torch
    v = (torch.arange(elems, device=device, dtype=torch.int64) * 7 + i) % 97
    return v.to(dtype)


def setup(allocator):
    if allocator != "native":
        os.environ["GPUPOOL_POOL"] = allocator
        import gpupool.torch
        gpupool.torch.install()


def consumer(allocator, inq, outq, profile=None, parts=False, warm=None, after=1):
    setup(allocator)
    import torch
    from multiprocessing.reduction import ForkingPickler
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    if warm is not None:
        n, seed, max_bytes = warm
        for i, (dt, elems, _view) in enumerate(items(n, seed, max_bytes)):
            pattern(i, elems, dt, "cuda")
        torch.cuda.synchronize()
    outq.put("ready")
    held = []
    receive = check = loads = 0.0
    part = {"pattern": 0.0, "equal": 0.0, "add": 0.0}
    # --check-parts: the pattern's and the comparison's time by the tensor's size, ms
    # (under 64 KiB, to 1 MiB, to 16 MiB, above).
    by_size = {"pattern_ms": [0.0] * 4, "equal_ms": [0.0] * 4}
    prof = cProfile.Profile() if profile else None
    fetch_ms = []
    if profile and allocator != "native":
        # Each handover's fetch on its own: the first connects, the rest reuse it.
        import gpupool.share
        fetch = gpupool.share._fetch

        def timed_fetch(ident):
            t = time.perf_counter()
            try:
                return fetch(ident)
            finally:
                fetch_ms.append(round((time.perf_counter() - t) * 1e3, 3))
        gpupool.share._fetch = timed_fetch
    def check_message(msg):
        """Check each tensor of `msg` against its pattern, then add 1 to the bases; the
        tensors' indices that were wrong."""
        bad = []
        for i, t, elems, view in msg:
            if parts:
                torch.cuda.synchronize()
                ta = time.perf_counter()
            want = pattern(i, elems, t.dtype, t.device)
            if parts:
                torch.cuda.synchronize()
                tb = time.perf_counter()
                part["pattern"] += tb - ta
            if not torch.equal(t, want if view is None else want[view:]):
                bad.append(i)
            if parts:
                tc = time.perf_counter()
                part["equal"] += tc - tb
                nb = t.numel() * t.element_size()
                k = 0 if nb < 1 << 16 else 1 if nb < 1 << 20 else 2 if nb < 16 << 20 else 3
                by_size["pattern_ms"][k] += (tb - ta) * 1e3
                by_size["equal_ms"][k] += (tc - tb) * 1e3
            held.append(t)
        ta = time.perf_counter()
        # Bases change only once every tensor (views of them included) was checked.
        for i, t, elems, view in msg:
            if view is None:
                t.add_(1)
        torch.cuda.synchronize()
        part["add"] += time.perf_counter() - ta
        return bad

    pending = []  # messages received, not checked yet
    while True:
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        # `inq.get()` in two parts, as multiprocessing's Queue.get does it, to time the
        # unpickling (rebuilding the tensors: the imports) apart from waiting for the bytes.
        with inq._rlock:
            res = inq._recv_bytes()
        inq._sem.release()
        tl = time.perf_counter()
        msg = ForkingPickler.loads(res)
        if isinstance(msg, bytes):  # --pickle-first: the producer's message, pickled ahead
            msg = ForkingPickler.loads(msg)
        t1 = time.perf_counter()
        if prof and isinstance(msg, str):
            prof.disable()
            if msg in ("report", "release"):  # the measured exchange is over
                write_profile(prof, os.path.join(profile, f"consumer-{allocator}.txt"))
                prof = None
                if fetch_ms:
                    with open(os.path.join(profile, f"consumer-fetch-ms-{allocator}.txt"), "w") as f:
                        f.write(" ".join(map(str, fetch_ms)) + "\n")
        if msg == "release":
            held.clear()
            torch.cuda.synchronize()
            import gc
            gc.collect()
            outq.put(("released", _live(allocator)))
            continue
        if msg == "report":
            outq.put(("report", _live(allocator)))
            continue
        if msg == "stop":
            outq.put(("stopped", _live(allocator)))
            return
        receive += t1 - t0
        loads += t1 - tl
        pending.append(msg)
        del msg
        if len(pending) < after:
            if prof:
                prof.disable()
            continue  # --check-after-all: checks start once every message is here
        for msg in pending:
            t1 = time.perf_counter()
            bad = check_message(msg)
            check += time.perf_counter() - t1
            outq.put(("checked", [m[0] for m in msg], bad, receive, check, loads, dict(part, **by_size) if parts else None))
        if prof:
            prof.disable()
        pending.clear()
        del msg  # only `held` keeps what was received


def _live(allocator):
    if allocator == "native":
        return None
    import gpupool
    s = gpupool.stats_json(0)
    calls = s.get("driver_calls") or {}
    ahead = getattr(gpupool.share, "ahead_counts", {})
    return {"live_blocks": s["n_live_blocks"], "imports": s.get("ipc_imports"),
            "import_address_space": s.get("ipc_import_address_space"),
            "driver_calls": {k: v for k, v in calls.items() if v},
            "opened_ahead": {k: round(v, 4) for k, v in ahead.items()},
            "ahead_costs": gpupool.share.ahead_costs() if hasattr(gpupool.share, "ahead_costs") else None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--allocator", choices=["native", "split", "arena"], required=True)
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--max-mib", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--profile", metavar="DIR")
    ap.add_argument("--check-parts", action="store_true")
    ap.add_argument("--warm-consumer", action="store_true")
    ap.add_argument("--check-after-all", action="store_true")
    ap.add_argument("--pickle-first", action="store_true")
    a = ap.parse_args()
    setup(a.allocator)
    import torch
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    inq, outq = ctx.Queue(), ctx.Queue()
    warm = (a.tensors, a.seed, a.max_mib << 20) if a.warm_consumer else None
    child = ctx.Process(target=consumer, args=(a.allocator, inq, outq, a.profile, a.check_parts, warm,
                                                       -(-a.tensors // a.batch) if a.check_after_all else 1), daemon=True)
    child.start()
    assert outq.get(timeout=300) == "ready"
    dev = torch.device("cuda", 0)
    spec = items(a.tensors, a.seed, a.max_mib << 20)
    tensors = [pattern(i, e, dt, dev) for i, (dt, e, _) in enumerate(spec)]
    torch.cuda.synchronize()
    result = {"allocator": a.allocator, "tensors": a.tensors, "bytes": sum(t.numel() * t.element_size() for t in tensors)}
    bad = []
    prof = cProfile.Profile() if a.profile else None
    if prof:
        # The queue pickles (and so exports) on its feeder thread: profile every pickling.
        from multiprocessing.reduction import ForkingPickler
        pickle_now = ForkingPickler.dumps

        depth = [0]

        def dumps(cls, obj, protocol=None):
            # Reentrant: gpupool's route wraps the pickler again at its first send, and a
            # profiler enabled twice is an error.
            depth[0] += 1
            if depth[0] == 1:
                prof.enable()
            try:
                return pickle_now(obj, protocol)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    prof.disable()
        dumps._gpupool = getattr(pickle_now, "_gpupool", False)  # routed already: no second route
        ForkingPickler.dumps = classmethod(dumps)
    batches = []
    for s in range(0, a.tensors, a.batch):
        batch = []
        for i in range(s, min(s + a.batch, a.tensors)):
            batch.append((i, tensors[i], spec[i][1], None))
            if spec[i][2] is not None:
                batch.append((i, tensors[i][spec[i][2]:], spec[i][1], spec[i][2]))
        batches.append(batch)
    del batch
    if a.pickle_first:
        from multiprocessing.reduction import ForkingPickler
        batches = [bytes(ForkingPickler.dumps(b)) for b in batches]
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for batch in batches:
        inq.put(batch)
    del batch, batches  # only `tensors` keeps the producer's own
    done = 0
    while done < a.tensors:
        kind, ids, b, receive, check, loads, part = outq.get(timeout=600)
        assert kind == "checked"
        done += len(set(ids))
        bad += b
    elapsed = time.perf_counter() - t0
    if prof:
        write_profile(prof, os.path.join(a.profile, f"producer-{a.allocator}.txt"))
    result["tensors_per_s"] = round(a.tensors / elapsed, 1)
    # Where the consumer's time went: in `get` (waiting, unpickling: the imports) and in
    # checking and changing the tensors.
    result["consumer_get_s"], result["consumer_check_s"] = round(receive, 3), round(check, 3)
    # Of `get`, the unpickling alone (rebuilding the tensors: opening the IPC handles or imports).
    result["consumer_loads_s"] = round(loads, 4)
    if part is not None:
        for k, v in part.items():
            if isinstance(v, list):
                result[f"consumer_{k}"] = [round(x, 1) for x in v]
            else:
                result[f"consumer_{k}_s"] = round(v, 4)
    result["elapsed_s"] = round(elapsed, 3)
    result["consumer_bad"] = len(bad)
    changed = sum(1 for i, t in enumerate(tensors) if not torch.equal(t, pattern(i, spec[i][1], t.dtype, dev) + 1))
    result["producer_sees_change_bad"] = changed
    if a.allocator != "native":
        import gpupool
        held_ptrs = {t.untyped_storage().data_ptr() for t in tensors}
        live_before = gpupool.stats_json(0)["n_live_blocks"]
        del tensors
        import gc
        gc.collect()
        torch.cuda.ipc_collect()
        # The consumer still holds every block: none may be freed, and new tensors of the same
        # sizes land elsewhere.
        live_held = gpupool.stats_json(0)["n_live_blocks"]
        again = [torch.empty(e, dtype=dt, device=dev) for dt, e, _ in spec]
        reused = sum(1 for t in again if t.untyped_storage().data_ptr() in held_ptrs)
        del again
        result["live_blocks_while_held"] = [live_before, live_held]
        inq.put("report")
        result["consumer_while_held"] = outq.get(timeout=300)[1]
        arena = gpupool.stats_json(0).get("arena")
        if arena:
            # What the consumer maps: whole granules (each block's, rounded up).
            g = arena["granule"]
            result["bytes_in_granules"] = sum(-(-(e * torch.empty((), dtype=dt).element_size()) // g) * g for dt, e, _ in spec)
        result["reused_while_held"] = reused
        inq.put("release")
        kind, consumer_live = outq.get(timeout=300)
        freed = None
        for _ in range(100):
            left = gpupool.share.collect()
            if left == 0:
                break
            time.sleep(0.05)
        gc.collect()
        freed = gpupool.stats_json(0)["n_live_blocks"]
        result["held_after_release"] = left
        result["live_blocks_after_release"] = freed
        result["consumer_after_release"] = consumer_live
    else:
        del tensors
        inq.put("release")
        outq.get(timeout=300)
    inq.put("stop")
    kind, consumer_end = outq.get(timeout=300)
    child.join(120)
    result["consumer_exit"] = child.exitcode
    result["consumer_end"] = consumer_end
    print(json.dumps(result))


if __name__ == "__main__":
    main()
