"""One storage sent a million times through torch.multiprocessing: nothing runs out, and
neither process's memory grows.

usage: same_storage_sends.py ALLOCATOR [SENDS] (native | gpupool; default 1,000,000)

The producer puts the same 1 MiB CUDA tensor on a queue SENDS times; the consumer reads one
element of every tenth message, drops each, and every 100,000 messages reports its live
CUDA memory, gpupool's open and kept imports and its resident set. The producer reports
the same of itself, and ipc_collect()s as it goes (PyTorch's sender keeps a block while a
receiver holds it). Prints one JSON line: sends/s, and the figures at each report.
"""
import json
import resource
import sys
import time

import torch
import torch.multiprocessing as mp

which = sys.argv[1]
sends = int(sys.argv[2]) if len(sys.argv) > 2 else 1_000_000
EVERY = 100_000


def install():
    if which == "gpupool":
        import gpupool
        gpupool.torch.install(compiled=True)
    elif which != "native":
        raise SystemExit(f"unknown allocator {which!r}")


def figures():
    out = {"allocated": torch.cuda.memory_allocated(), "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10}
    if which == "gpupool":
        import gpupool
        j = gpupool.stats_json(0)
        out.update(imports=j.get("ipc_imports"), kept=j.get("ipc_imports_kept"), live_blocks=j.get("n_live_blocks"))
    return out


def consumer(q, back, n):
    install()
    torch.empty(1, device="cuda")
    back.put("ready")
    for i in range(1, n + 1):
        t = q.get()
        if i % 10 == 0:
            assert int(t[7].item()) == 7
        del t
        if i % EVERY == 0:
            back.put(figures())


def main():
    install()
    ctx = mp.get_context("spawn")
    q, back = ctx.Queue(maxsize=1000), ctx.Queue()
    p = ctx.Process(target=consumer, args=(q, back, sends))
    p.start()
    assert back.get(timeout=300) == "ready"
    x = torch.arange(1 << 18, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    reports = []
    t = time.perf_counter()
    for i in range(1, sends + 1):
        q.put(x)
        if i % EVERY == 0:
            torch.cuda.ipc_collect()
            reports.append({"sent": i, "producer": figures()})
    for r in reports:
        r["consumer"] = back.get(timeout=600)
    dt = time.perf_counter() - t
    p.join(60)
    print(json.dumps({"allocator": which, "sends": sends, "sends_per_s": round(sends / dt), "exitcode": p.exitcode,
                      "reports": reports}))


if __name__ == "__main__":
    main()
