"""The receiving side's own work on the CPU (host upstream): a producer sends N arena
blocks (sizes log-uniform 256 B - MAX) in messages of BATCH through a spawn queue, as
share_check.py does on a GPU; the consumer keeps every block (a DLPack tensor each), times
the unpickling of each message and reports opening-ahead's counts (start_s, take_s).
On the host an import is mmap work, so what is timed is the route's own overhead.

    python3 ahead_cpu.py [N] [BATCH] [MAX_BYTES] [--profile] [--torch-layout]

--torch-layout: the blocks lie as share_check.py's producer leaves them under PyTorch (each
made after four int64 temporaries of 8 bytes an element, freed; share_layout.py), so
small blocks sit in chunks that large temporaries grew, and each send lists its chunks'
every granule.
"""
import ctypes, multiprocessing, os, random, sys, time

import gpupool


class Held:
    # Exported while pickled; rebuilt as an opened import kept by the consumer.
    def __init__(self, ptr, size):
        self.ptr, self.size = ptr, size

    def __reduce__(self):
        return (_open, (gpupool.share.export(self.ptr, self.size, 0, self),))


def _open(sent):
    return gpupool.share.Received(sent).open_dlpack(0)


def consume(inq, outq, profile):
    gpupool.configure(0, pool="arena", upstream="host")
    gpupool.share.route_multiprocessing()
    from multiprocessing.reduction import ForkingPickler
    import cProfile, pstats, io
    prof = cProfile.Profile() if profile else None
    outq.put("ready")
    held, loads = [], 0.0
    while True:
        with inq._rlock:
            res = inq._recv_bytes()
        inq._sem.release()
        t = time.perf_counter()
        if prof:
            prof.enable()
        msg = ForkingPickler.loads(res)
        if prof:
            prof.disable()
        if isinstance(msg, str):
            break
        loads += time.perf_counter() - t
        held += msg
    counts = dict(gpupool.share.ahead_counts)
    counts["library"] = gpupool.share.ahead_costs()
    n = len(held)
    for m in held:
        gpupool.share.delete_dlpack(m)
    text = ""
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        text = s.getvalue()
    outq.put((n, loads, counts, text))


def _desc_granules(p):
    from gpupool.share import _export_bytes
    from gpupool import ipc_descriptor_fds
    return ipc_descriptor_fds(_export_bytes(p))


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    n = int(args[0]) if args else 1000
    batch = int(args[1]) if len(args) > 1 else 50
    most = int(args[2]) if len(args) > 2 else 4 << 20
    gpupool.configure(0, pool="arena", upstream="host")
    gpupool.share.route_multiprocessing()
    L = gpupool.lib()
    rng = random.Random(1)
    def alloc(size):
        p = ctypes.c_void_p()
        assert L.gpupool_malloc(ctypes.byref(p), size, 0, None) == 0
        return p.value

    def free(p):
        assert L.gpupool_free(ctypes.c_void_p(p), 0, None) == 0

    ptrs = []
    for i in range(n):
        size = int(256 * (most / 256) ** rng.random())
        if "--torch-layout" in sys.argv:
            es = (4, 2, 1, 8)[i % 4]
            elems = max(8, size // es)
            t = alloc(8 * elems)
            for _ in range(3):
                t2 = alloc(8 * elems)
                free(t)
                t = t2
            if es == 8:
                ptrs.append((t, 8 * elems))
                continue
            ptrs.append((alloc(es * elems), es * elems))
            free(t)
            continue
        ptrs.append((alloc(size), size))
    ctx = multiprocessing.get_context("spawn")
    inq, outq = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=consume, args=(inq, outq, "--profile" in sys.argv), daemon=True)
    child.start()
    assert outq.get(timeout=120) == "ready"
    from multiprocessing.reduction import ForkingPickler
    t = time.perf_counter()
    for i in range(0, n, batch):
        msg = [Held(p, s) for p, s in ptrs[i:i + batch]]
        inq.put(msg)
    inq.put("stop")
    got, loads, counts, text = outq.get(timeout=300)
    elapsed = time.perf_counter() - t
    child.join(60)
    print(text)
    print({"blocks": got, "elapsed_s": round(elapsed, 4), "loads_s": round(loads, 4),
           "granule_entries": sum(len(_desc_granules(p)) for p, _ in ptrs),
           **{k: round(v, 4) if isinstance(v, float) else v for k, v in counts.items()}})
    for p, _ in ptrs:
        L.gpupool_free(ctypes.c_void_p(p), 0, None)


if __name__ == "__main__":
    main()
