#!/usr/bin/env python3
"""Session 32: serving (scripts/bench_workloads.py's `run` mode, one process) with two
measures of the host's speed taken in the same process at the end of warm-up, outside every
step: a pure-Python loop (no CUDA) and 20,000 launches of an in-place add on a tensor made
before (kernel launches, no allocation). Prints the benchmark's JSON line with them added,
so rounds of different allocators can be compared against the speed of the host they ran on.

    python3 serving_cpu_probe.py ALLOCATOR
"""
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(REPO / "scripts"))
import bench_workloads as bw  # noqa: E402
import workloads_measure as wm  # noqa: E402

probe = {}
orig_mark = wm.Recorder.mark_warm


def mark_warm(self):
    torch = self.torch
    t0 = time.perf_counter()
    x = 0
    for i in range(2_000_000):
        x += i
    probe["py_loop_ms"] = (time.perf_counter() - t0) * 1e3
    t = torch.zeros(16, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20_000):
        t.add_(1)
    torch.cuda.synchronize()
    probe["launch_us"] = (time.perf_counter() - t0) / 20_000 * 1e6
    del t
    torch.cuda.synchronize()
    orig_mark(self)


orig_dumps = json.dumps


def dumps(obj, *a, **k):
    if isinstance(obj, dict) and "workload" in obj:
        obj = {**obj, **probe}
    return orig_dumps(obj, *a, **k)


wm.Recorder.mark_warm = mark_warm
bw.json.dumps = dumps
bw.run("serving", sys.argv[1])
