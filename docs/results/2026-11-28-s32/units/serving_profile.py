#!/usr/bin/env python3
"""Session 32: where serving's step time goes under one allocator. Runs
scripts/bench_workloads.py's serving workload (`run` mode's setup, one process) with
torch.profiler on over measured steps FIRST..LAST, then prints the profiler's totals: every
kernel's device time, the CPU time of the operators that allocate, and the top operators by
self CPU and kernels by device time. Run it once per allocator and compare.

    python3 serving_profile.py ALLOCATOR [FIRST LAST] > profile-ALLOCATOR.txt
"""
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(REPO / "scripts"))
import bench_workloads as bw  # noqa: E402
import workloads_measure as wm  # noqa: E402

alloc = sys.argv[1]
first, last = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (20, 80)
state = {"prof": None, "n": 0, "steps": []}
orig_step = wm.Recorder.step


def step(self):
    torch = self.torch
    cm = orig_step(self)

    class Wrapped:
        def __enter__(s):
            if self.measuring and state["n"] == first:
                state["prof"] = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
                state["prof"].__enter__()
            s.t0 = time.perf_counter()
            return cm.__enter__()

        def __exit__(s, *exc):
            r = cm.__exit__(*exc)
            if self.measuring:
                if first <= state["n"] < last:
                    state["steps"].append(time.perf_counter() - s.t0)
                state["n"] += 1
                if state["n"] == last and state["prof"] is not None:
                    state["prof"].__exit__(None, None, None)
                    report(state["prof"])
            return r
    return Wrapped()


def report(prof):
    ev = prof.key_averages()
    steps = state["steps"]
    dev = sum(e.self_device_time_total for e in ev)
    cpu = sum(e.self_cpu_time_total for e in ev)
    print(f"allocator {alloc}: steps {first}-{last} profiled, mean step {1e3 * sum(steps) / len(steps):.2f} ms "
          f"(median {1e3 * sorted(steps)[len(steps) // 2]:.2f})")
    print(f"total self device time {dev / 1e3:.1f} ms ({dev / 1e3 / len(steps):.2f} ms a step); "
          f"total self CPU time {cpu / 1e3:.1f} ms ({cpu / 1e3 / len(steps):.2f} ms a step)")
    for name in ("aten::empty", "aten::empty_strided", "aten::resize_", "cudaLaunchKernel", "cuLaunchKernel",
                 "cudaMemcpyAsync", "cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::cat", "aten::copy_"):
        for e in ev:
            if e.key == name:
                print(f"  {name:28s} calls {e.count:8d} self CPU {e.self_cpu_time_total / 1e3:9.1f} ms "
                      f"({e.self_cpu_time_total / max(e.count, 1):.2f} us each) device {e.self_device_time_total / 1e3:8.1f} ms")
    print("\n-- top by self device time")
    print(ev.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=60))
    print("\n-- top by self CPU time")
    print(ev.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    sys.stdout.flush()


wm.Recorder.step = step
bw.run("serving", alloc)
