"""Where churn's step time goes, per allocator, in one process each: the churn workload's
sequence (scripts/workloads.py, BENCH_SEED 0) timed in three ways over the same 30,000
replacements after a 5,000-replacement warm-up:
  pairs   free + torch.empty only (the allocator's calls through PyTorch, no kernel);
  touch   the workload's own op: free + torch.empty + `t[0] = 1`;
  kernel  `t[0] = 1` on a block kept live (the launch and write alone).
    python3 churn_parts.py native|split|arena
Prints one JSON line: microseconds an op for each."""
import json, math, os, random, sys, time

alloc = sys.argv[1]
if alloc != "native":
    os.environ["GPUPOOL_POOL"] = alloc
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "python"))
    import gpupool.torch
    gpupool.torch.install()
import torch

torch.ones(1, device="cuda").add_(1)
rng, lo, hi = random.Random(1234), math.log(512), math.log(32 << 20)
size = lambda: int(math.exp(rng.uniform(lo, hi)))
slots = [torch.empty(size(), dtype=torch.uint8, device="cuda") for _ in range(256)]


def run(n, touch, alloc_on=True):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        i = rng.randrange(256)
        if alloc_on:
            slots[i] = None
            slots[i] = torch.empty(size(), dtype=torch.uint8, device="cuda")
        if touch:
            slots[i][0] = 1
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


run(5000, True)
out = {"allocator": alloc, "device": torch.cuda.get_device_name()}
for k in range(3):
    out.setdefault("pairs", []).append(round(run(10000, False), 2))
    out.setdefault("touch", []).append(round(run(10000, True), 2))
    out.setdefault("kernel", []).append(round(run(10000, True, alloc_on=False), 2))
print(json.dumps(out))
