"""A model's weights pushed to another process through torch.multiprocessing, by allocator.

usage: state_dict_send.py ALLOCATOR [SENDS]
ALLOCATOR: native | expandable | gpupool (gpupool's allocator class, both processes) |
           gpupool-split (the same with GPUPOOL_POOL=split) |
           gpupool-tag (the producer allocates its state dicts under a tag) |
           gpupool-tag-native (the same, to a consumer on PyTorch's own allocator, which
           never imports gpupool: a rollout engine)

What RL trainers do to feed rollout workers: the producer puts a state dict on a queue (147
bf16 CUDA tensors, 1.8 GB, the shapes of a 16-layer LLM with hidden size 2048), the consumer
sums every tensor and answers with the sums, which the producer checks against its own.
Timed per send, from the put to the answer:
  cold:   the first send;
  resend: the same storages sent again (SENDS times, default 10);
  fresh:  a new state dict each send, the previous one freed first (SENDS times).
Prints one JSON line: the median seconds of each kind, and under gpupool the consumer's
import figures (driver calls of the kinds an import makes, kept and reused imports) and
both processes' live memory at the end. `cold_parts` splits the cold send: the producer's
pickling (`pickle_s`: where its exports are made), the consumer's unpickling (`loads_s`:
where it imports) and its sums (`sums_s`); under gpupool also the seconds the consumer's
imports spent in each kind of driver call and how many allocations it imported
(`imports`). Each send is pickled by the producer before it goes on the queue, so that the
parts can be told apart.
"""
import json
import os
import statistics
import sys
import time

which = sys.argv[1]
sends = int(sys.argv[2]) if len(sys.argv) > 2 else 10
if which == "expandable":
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
elif which == "gpupool-split":
    os.environ["GPUPOOL_POOL"] = "split"
elif which not in ("native", "gpupool", "gpupool-tag", "gpupool-tag-native"):
    raise SystemExit(f"unknown allocator {which!r}")
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from multiprocessing.reduction import ForkingPickler  # noqa: E402

GPUPOOL = which.startswith("gpupool")
TAGGED = which.startswith("gpupool-tag")
CONSUMER_GPUPOOL = GPUPOOL and which != "gpupool-tag-native"
HIDDEN, FFN, LAYERS, VOCAB = 2048, 5632, 16, 32000


def install(consumer=False):
    if CONSUMER_GPUPOOL if consumer else GPUPOOL:
        import gpupool
        gpupool.torch.install(compiled=True)


def shapes():
    out = [("embed", (VOCAB, HIDDEN))]
    for i in range(LAYERS):
        out += [(f"{i}.q", (HIDDEN, HIDDEN)), (f"{i}.k", (HIDDEN, HIDDEN)), (f"{i}.v", (HIDDEN, HIDDEN)),
                (f"{i}.o", (HIDDEN, HIDDEN)), (f"{i}.gate", (FFN, HIDDEN)), (f"{i}.up", (FFN, HIDDEN)),
                (f"{i}.down", (HIDDEN, FFN)), (f"{i}.norm1", (HIDDEN,)), (f"{i}.norm2", (HIDDEN,))]
    return out + [("norm", (HIDDEN,)), ("lm_head", (VOCAB, HIDDEN))]


def make(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if TAGGED:
        import gpupool
        with gpupool.tag("weights"):
            return {k: torch.randn(s, device="cuda", generator=g, dtype=torch.float32).to(torch.bfloat16)
                    for k, s in shapes()}
    return {k: torch.randn(s, device="cuda", generator=g, dtype=torch.float32).to(torch.bfloat16) for k, s in shapes()}


def sums(sd):
    return [float(t.float().sum().item()) for t in sd.values()]


def import_figures(consumer=False):
    if not (CONSUMER_GPUPOOL if consumer else GPUPOOL):
        return None
    import gpupool
    j = gpupool.stats_json(0)
    calls = j.get("driver_calls", {})
    keep = ("shareable", "mem_map", "mem_unmap", "set_access", "address_reserve", "event_sync")
    return {"calls": {k: calls.get(k) for k in keep}, "imports": j.get("ipc_imports"),
            "kept": j.get("ipc_imports_kept"), "reuses": j.get("ipc_import_reuses")}


def import_costs():
    """The seconds this process's imports spent in each kind of driver call so far, and
    how many allocations they imported (`gpupool.share.ahead_costs`)."""
    import gpupool.share
    costs = dict(gpupool.share.ahead_costs().get("imports") or {})
    return {"imports": costs.pop("count", None), "import_s": {k: round(v, 4) for k, v in costs.items()}}


def consumer(q, back):
    install(consumer=True)
    torch.empty(1, device="cuda")
    back.put("ready")
    cold = True
    while True:
        pickled = q.get()
        if pickled is None:
            break
        t0 = time.perf_counter()
        msg = ForkingPickler.loads(pickled)
        t1 = time.perf_counter()
        s = sums(msg)
        t2 = time.perf_counter()
        del msg
        parts = {"loads_s": round(t1 - t0, 4), "sums_s": round(t2 - t1, 4)}
        if cold and CONSUMER_GPUPOOL:
            parts.update(import_costs())
        cold = False
        back.put((s, parts))
    torch.cuda.synchronize()
    back.put({"figures": import_figures(consumer=True), "allocated": torch.cuda.memory_allocated(),
              "gpupool_loaded": "gpupool" in sys.modules})


def main():
    install()
    ctx = mp.get_context("spawn")
    q, back = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=consumer, args=(q, back))
    p.start()
    assert back.get(timeout=300) == "ready"

    def send(sd, want, parts=None):
        torch.cuda.synchronize()
        t = time.perf_counter()
        pickled = bytes(ForkingPickler.dumps(sd))
        tp = time.perf_counter()
        q.put(pickled)
        got, consumer_parts = back.get(timeout=300)
        dt = time.perf_counter() - t
        assert got == want, "the consumer's sums differ from the producer's"
        if parts is not None:
            parts.update({"pickle_s": round(tp - t, 4), **consumer_parts})
        return dt

    sd = make(0)
    want = sums(sd)
    cold_parts = {}
    cold = send(sd, want, cold_parts)
    resend = [send(sd, want) for _ in range(sends)]
    fresh = []
    for i in range(sends):
        del sd
        torch.cuda.ipc_collect()
        sd = make(i + 1)
        fresh.append(send(sd, sums(sd)))
    q.put(None)
    end = back.get(timeout=300)
    p.join(60)
    del sd
    torch.cuda.ipc_collect()
    print(json.dumps({
        "allocator": which, "tensors": len(shapes()), "sends": sends,
        "bytes": sum(2 * torch.Size(s).numel() for _, s in shapes()),
        "cold_s": round(cold, 4), "cold_parts": cold_parts, "resend_s": round(statistics.median(resend), 4),
        "fresh_s": round(statistics.median(fresh), 4),
        "resend_range_s": [round(min(resend), 4), round(max(resend), 4)],
        "fresh_range_s": [round(min(fresh), 4), round(max(fresh), 4)],
        "consumer": end, "producer_allocated_after": torch.cuda.memory_allocated(),
        "producer_figures": import_figures(),
    }))


if __name__ == "__main__":
    main()
