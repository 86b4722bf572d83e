"""Write shared/bench/churn.py's churn sequence (same seed, 256 slots, log-uniform sizes in
[512 B, 32 MiB]) as a GPUPOOL_TRACE file, so gpupool-replay can study the benchmark offline:

    python3 scripts/churn_trace.py > /tmp/churn.csv
    cargo run --release --bin gpupool-replay -- /tmp/churn.csv --pool split [--decay N|off] [--upstream device|vmm]
"""
import math
import random
import sys

n = int(sys.argv[1]) if len(sys.argv) > 1 else 100000
rng = random.Random(1234)  # churn.py's seed and draw order
lo, hi = math.log(512), math.log(32 << 20)
seq = [(rng.randrange(256), int(math.exp(rng.uniform(lo, hi)))) for _ in range(n)]
slots = [None] * 256
print("time_ns,thread,device,stream,action,ptr,size")
t = 0
for i, (s, size) in enumerate(seq, start=1):
    if slots[s] is not None:
        ptr, old = slots[s]
        print(f"{t},1,0,0x0,free,{ptr:#x},{old}")
        t += 1
    slots[s] = (i * 4096, size)
    print(f"{t},1,0,0x0,alloc,{i * 4096:#x},{size}")
    t += 1
