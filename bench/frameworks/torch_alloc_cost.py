"""What one allocation and free costs through PyTorch, by allocator (one per process).

usage: torch_alloc_cost.py ALLOCATOR [ROUNDS]
ALLOCATOR: native | expandable (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) |
           gpupool (gpupool's allocator class) | gpupool-plugin (PyTorch's plug-in class)
Prints one JSON line: the median over ROUNDS (default 7) of microseconds per pair for
  fixed:  torch.empty(4096 floats) + del, 100,000 times (the framework's fast path)
  shapes: torch.empty of a new size every step (log-uniform in [512 B, 8 MiB], 64 live,
          the same seeded sequence every run), 50,000 steps
and how many memory_allocated() + memory_stats() calls a second (what training loggers do).
"""
import json
import math
import os
import random
import statistics
import sys
import time

which = sys.argv[1]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 7
if which == "expandable":
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
import torch  # noqa: E402

if which == "gpupool":
    import gpupool
    gpupool.torch.install(compiled=True)
elif which == "gpupool-plugin":
    import gpupool
    gpupool.torch.install(compiled=False)
elif which not in ("native", "expandable"):
    raise SystemExit(f"unknown allocator {which!r}")
torch.empty(1, device="cuda")


def fixed(n=100_000):
    t = time.perf_counter()
    for _ in range(n):
        x = torch.empty(4096, device="cuda")
        del x
    return (time.perf_counter() - t) / n * 1e6


rng = random.Random(7)
SIZES = [int(math.exp(rng.uniform(math.log(512), math.log(8 << 20)))) for _ in range(50_000)]
SLOTS = [rng.randrange(64) for _ in range(50_000)]


def shapes():
    live = [None] * 64
    t = time.perf_counter()
    for n, slot in zip(SIZES, SLOTS):
        live[slot] = torch.empty(n, dtype=torch.uint8, device="cuda")
    del live
    return (time.perf_counter() - t) / len(SIZES) * 1e6


def stats_calls(n=2000):
    t = time.perf_counter()
    for _ in range(n):
        torch.cuda.memory_allocated()
        torch.cuda.memory_stats()
    return n / (time.perf_counter() - t)


fixed()  # warm-up: the pool's first growth, the thread's caches
shapes()
res = {"allocator": which, "fixed_us": [], "shapes_us": [], "stats_per_s": []}
for _ in range(rounds):
    res["fixed_us"].append(fixed())
    res["shapes_us"].append(shapes())
    res["stats_per_s"].append(stats_calls())
torch.cuda.synchronize()
out = {k: round(statistics.median(v), 3) for k, v in res.items() if isinstance(v, list)}
out.update(allocator=which, rounds=rounds, peak_reserved_over_allocated=round(
    torch.cuda.max_memory_reserved() / max(1, torch.cuda.max_memory_allocated()), 3))
print(json.dumps(out))
