"""What one small PyTorch operation costs on the CPU under each allocator (session 26):
share_check's consumer checks ran 30-60 ms slower per 1,000 tensors under gpupool (split
and arena alike) than under PyTorch's own allocator, with its pool already grown. Each
case runs N times after a warm-up; microseconds per iteration, median of 5 repeats.

    python3 torch_ops.py ALLOCATOR [N]     (ALLOCATOR: native | split | arena | split-plain)

split-plain: gpupool's split pool with its own allocation function instead of the compiled
out-of-memory shim (GPUPOOL_TORCH_TYPED_OOM=0).
"""
import os
import statistics
import sys
import time

alloc = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 20000
if alloc != "native":
    os.environ["GPUPOOL_POOL"] = alloc.split("-")[0]
    if alloc.endswith("-plain"):
        os.environ["GPUPOOL_TORCH_TYPED_OOM"] = "0"
    import gpupool.torch
    gpupool.torch.install()
import torch

x = torch.ones(256, device="cuda")
y = torch.ones(256, device="cuda")
big = torch.ones(1 << 20, device="cuda")


def empty():
    torch.empty(256, device="cuda")


def empty_1m():
    torch.empty(1 << 20, device="cuda")


def add_inplace():
    x.add_(1)


def add_new():
    x + 1


def equal():
    torch.equal(x, y)


def arange_chain():
    ((torch.arange(256, device="cuda", dtype=torch.int64) * 7 + 1) % 97).to(torch.float32)


CASES = [empty, empty_1m, add_inplace, add_new, equal, arange_chain]
out = {"allocator": alloc}
for f in CASES:
    for _ in range(1000):
        f()
    torch.cuda.synchronize()
    reps = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            f()
        torch.cuda.synchronize()
        reps.append((time.perf_counter() - t) / n * 1e6)
    out[f.__name__] = round(statistics.median(reps), 2)
print(out)
