"""Is reading received memory slower the first time, or every time? (session 26) share_check's
consumer compared received tensors more slowly under gpupool than under PyTorch's own
allocator, even with its own pool grown beforehand. Here a producer sends N tensors of one
size through a torch.multiprocessing queue; the consumer makes the expected values first,
then times torch.equal over every received tensor three passes in a row, and over clones
of them (its own memory) last. ms per pass.

    python3 first_touch.py ALLOCATOR [N] [BYTES]     (native | split | arena)
"""
import os
import sys
import time


def setup(alloc):
    if alloc != "native":
        os.environ["GPUPOOL_POOL"] = alloc
        import gpupool.torch
        gpupool.torch.install()


def consumer(alloc, inq, outq):
    setup(alloc)
    import torch
    torch.zeros(1, device="cuda")
    outq.put("ready")
    got = []
    while True:
        m = inq.get()
        if m == "end":
            break
        got += m
    torch.cuda.synchronize()
    want = [torch.full_like(t, 1.0) for t in got]
    clones = [t.clone() for t in got]
    for t, w in zip(got, want):  # kernels loaded, nothing received touched yet
        torch.equal(w, w)
    torch.cuda.synchronize()
    out = {}
    for name, ts in (("received_1", got), ("received_2", got), ("received_3", got), ("clones", clones)):
        t0 = time.perf_counter()
        ok = all(torch.equal(t, w) for t, w in zip(ts, want))
        out[name] = round((time.perf_counter() - t0) * 1e3, 2)
        assert ok
    outq.put(out)


def main():
    alloc = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 400
    nbytes = int(sys.argv[3]) if len(sys.argv) > 3 else 1 << 20
    setup(alloc)
    import torch
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    inq, outq = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=consumer, args=(alloc, inq, outq), daemon=True)
    p.start()
    assert outq.get(timeout=300) == "ready"
    ts = [torch.ones(nbytes // 4, device="cuda") for _ in range(n)]
    torch.cuda.synchronize()
    for s in range(0, n, 50):
        inq.put(ts[s:s + 50])
    inq.put("end")
    r = outq.get(timeout=300)
    p.join(60)
    print({"allocator": alloc, "n": n, "bytes": nbytes, **r})


if __name__ == "__main__":
    main()
