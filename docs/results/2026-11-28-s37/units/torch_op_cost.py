"""What one allocation and free costs through PyTorch, by allocator (session 37): native,
or gpupool's split / arena through `gpupool.torch.install()` (PyTorch's
CUDAPluggableAllocator). One process per call; prints one JSON line:
  empty_us    `x = torch.empty(4096, device="cuda"); del x`, mean of 200,000 (no kernel)
  add_us      `c = a + b` on 1,024-element tensors, mean of 100,000 (a launch and an allocation)
  loop_ms     a pure-Python loop of 1,000,000 additions: the process's host speed
  patterns_s  scripts/share_check.py's consumer check without the sharing: the expected
              pattern of each of its 1,000 tensors (its own allocations and kernels) and a
              comparison with a copy made before the clock (which grew the pool), two
              passes (`_1`, `_2`)
    python3 torch_op_cost.py native|split|arena
"""
import json
import os
import sys
import time

alloc = sys.argv[1]
if alloc != "native":
    os.environ["GPUPOOL_POOL"] = alloc
    import gpupool.torch
    gpupool.torch.install()
import torch

torch.cuda.init()
a = torch.ones(1024, device="cuda")
b = torch.ones(1024, device="cuda")


def timed(fn, n):
    fn(n // 10)
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn(n)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def empties(n):
    for _ in range(n):
        x = torch.empty(4096, device="cuda")
        del x


def adds(n):
    for _ in range(n):
        c = a + b
        del c


def loop():
    t = time.perf_counter()
    x = 0
    for i in range(1_000_000):
        x += i
    return (time.perf_counter() - t) * 1e3


out = {"allocator": alloc, "loop_ms": round(loop(), 1)}
out["empty_us"] = round(timed(empties, 200_000), 3)
out["add_us"] = round(timed(adds, 100_000), 3)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "..", "scripts"))
import share_check  # noqa: E402

spec = share_check.items(1000, 1, 64 << 20)
copies = []
for i, (dt, elems, _v) in enumerate(spec):
    copies.append(share_check.pattern(i, elems, dt, "cuda").clone())
    torch.cuda.synchronize()


def patterns():
    torch.cuda.synchronize()
    t = time.perf_counter()
    bad = 0
    for i, (dt, elems, _v) in enumerate(spec):
        if not torch.equal(copies[i], share_check.pattern(i, elems, dt, "cuda")):
            bad += 1
    torch.cuda.synchronize()
    return round(time.perf_counter() - t, 4), bad


out["patterns_s_1"], bad0 = patterns()
out["patterns_s_2"], bad1 = patterns()
out["patterns_bad"] = bad0 + bad1
out["loop_ms_after"] = round(loop(), 1)
print(json.dumps(out))
