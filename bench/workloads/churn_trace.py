"""Write bench/frameworks/churn.py's churn sequence (same seed, 256 slots, log-uniform sizes in
[512 B, 32 MiB]) as a GPUPOOL_TRACE file, so gpupool-replay can study the benchmark offline:

    python3 bench/workloads/churn_trace.py > /tmp/churn.csv
    cargo run --release --bin gpupool-replay -- /tmp/churn.csv --pool split [--decay N|off] [--upstream device|vmm]

`--bounds` prints instead what no pool can beat: the live bytes at the end, and what a pool
without any fragmentation or rounding would hold at the end if it kept the peak of the last
W allocations (the quantity cache decay tracks), as a multiple of the live bytes, with the
memory such a pool must obtain from the driver over the run (the total rise of that peak).
"""
import math
import random
import sys
from collections import deque

args = [a for a in sys.argv[1:] if a != "--bounds"]
n = int(args[0]) if args else 100000
rng = random.Random(1234)  # churn.py's seed and draw order
lo, hi = math.log(512), math.log(32 << 20)
seq = [(rng.randrange(256), int(math.exp(rng.uniform(lo, hi)))) for _ in range(n)]
if "--bounds" in sys.argv:
    sizes, live, series = [0] * 256, 0, []
    for s, size in seq:
        live += size - sizes[s]
        sizes[s] = size
        series.append(live)
    end = series[-1]
    print(f"live at the end {end / 2**20:.0f} MiB, all-time peak {max(series) / 2**20:.0f} MiB")
    for w in (1024, 8192, 16384, 32768, n):
        # The window peak such a pool holds, step by step (a sliding maximum); its total
        # rise is memory the pool must obtain from the driver over the run, at the least.
        window, rise, held = deque(), 0, 0
        for i, v in enumerate(series):
            while window and series[window[-1]] <= v:
                window.pop()
            window.append(i)
            if window[0] <= i - w:
                window.popleft()
            rise += max(0, series[window[0]] - held)
            held = series[window[0]]
        print(f"peak of the last {w} allocations / live at the end: {max(series[-w:]) / end:.3f}; "
              f"memory obtained over the run, at the least: {rise / 2**30:.2f} GiB")
    sys.exit(0)
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
