"""share_check's consumer check without a second process (session 26): make each of the
1,000 expected patterns and compare it with a copy, synchronising around each part, in one
process under one allocator; the time of each part summed by tensor size (ms). Shows
whether the check's kernels run slower over gpupool's memory than over PyTorch's own, apart
from anything received.

    python3 pattern_times.py ALLOCATOR [ROUNDS]     (native | split | arena)
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../../../scripts"))
import share_check  # noqa: E402

alloc = sys.argv[1]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
share_check.setup(alloc)
import torch  # noqa: E402

spec = share_check.items(1000, 1, 64 << 20)
dev = torch.device("cuda", 0)
held = [share_check.pattern(i, e, dt, dev) for i, (dt, e, _) in enumerate(spec)]  # what the producer sends
torch.cuda.synchronize()
buckets = [(0, 1 << 16), (1 << 16, 1 << 20), (1 << 20, 16 << 20), (16 << 20, 1 << 40)]
for r in range(rounds):
    pat = [0.0] * len(buckets)
    eq = [0.0] * len(buckets)
    for i, (dt, e, _) in enumerate(spec):
        nb = held[i].numel() * held[i].element_size()
        b = next(k for k, (lo, hi) in enumerate(buckets) if lo <= nb < hi)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        want = share_check.pattern(i, e, dt, dev)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        ok = torch.equal(held[i], want)
        t2 = time.perf_counter()
        assert ok
        pat[b] += t1 - t0
        eq[b] += t2 - t1
    print({"allocator": alloc, "round": r, "pattern_ms": [round(x * 1e3, 1) for x in pat], "equal_ms": [round(x * 1e3, 1) for x in eq],
           "buckets": ["<64K", "64K-1M", "1M-16M", ">=16M"]})
