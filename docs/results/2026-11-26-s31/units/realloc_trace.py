"""threads_bench's serving row for one thread as a GPUPOOL_TRACE (tests/gpu/threads_bench_workloads.c,
tests/replay.rs's realloc_serving_loop, with Python's own random draws): 128 pairs of 1 MiB,
then 120,000 tokens, each growing one of 32 buffers by 64 KiB by reallocation (the longer
buffer allocated before the old one is freed), a buffer restarting at 64 KiB once it reaches
its length (256 KiB to 8 MiB).
    python3 realloc_trace.py /tmp/realloc.csv && gpupool-replay /tmp/realloc.csv --pool arena"""
import random
import sys

rng = random.Random(5)
rows = ["time_ns,thread,device,stream,action,ptr,size"]
t = ptr = 0


def alloc(n):
    global t, ptr
    t += 1
    ptr += 0x1000
    rows.append(f"{t},1,0,0x0,alloc,{ptr:#x},{n}")
    return (ptr, n)


def free(b):
    global t
    t += 1
    rows.append(f"{t},1,0,0x0,free,{b[0]:#x},{b[1]}")


for _ in range(128):
    free(alloc(1 << 20))
TOKEN = 64 << 10
bufs, lengths = [None] * 32, [0] * 32
for _ in range(120 * 1000):
    r = rng.randrange(32)
    if bufs[r] is not None and bufs[r][1] < lengths[r]:
        n = bufs[r][1] + TOKEN
    else:
        lengths[r] = (256 << 10) + rng.randrange(32) * (256 << 10)
        n = TOKEN
    b = alloc(n)
    if bufs[r] is not None:
        free(bufs[r])
    bufs[r] = b
with open(sys.argv[1], "w") as f:
    f.write("\n".join(rows) + "\n")
