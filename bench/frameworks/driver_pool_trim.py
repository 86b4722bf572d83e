"""Can the driver's own stream-ordered pool (cuMemAllocAsync) give memory back at fine
granularity? Evidence for the pool's design (docs/internals.md), run on the GPU machine.

usage: python3 bench/frameworks/driver_pool_trim.py [LIBGPUPOOL]

Runs bench/frameworks/churn.py's churn sequence (same seed, 256 slots, log-uniform sizes in
[512 B, 32 MiB]) through CuPy in child processes, one configuration each:
  - CuPy's MemoryAsyncPool (cudaMallocAsync per allocation) with the default pool's release
    threshold untouched, 0, and the maximum, and with cuMemPoolTrimTo(0) every 1000 steps;
  - gpupool on the `async` upstream with decay (it gives segments back to the driver's pool),
    and on `device` with decay, for comparison (needs LIBGPUPOOL).
After the loop and a device synchronise it prints, over the live bytes: device memory used
(what churn.py reports), the same after cuMemPoolTrimTo(pool, 0), and the driver pool's own
reserved and used figures; also µs per step and per trim.
"""
import ctypes
import json
import math
import os
import random
import subprocess
import sys
import time

# cudaMemPoolAttr values (CUDA runtime API): release threshold, reserved and used memory.
ATTR_RELEASE_THRESHOLD, ATTR_RESERVED_CURRENT, ATTR_USED_CURRENT = 4, 5, 7


def child(mode, so):
    import cupy
    from cupy.cuda import runtime as rt
    pool = rt.deviceGetDefaultMemPool(0)
    if os.environ.get("THRESHOLD") is not None:
        rt.memPoolSetAttribute(pool, ATTR_RELEASE_THRESHOLD, int(os.environ["THRESHOLD"]))
    if mode == "async":
        cupy.cuda.set_allocator(cupy.cuda.MemoryAsyncPool().malloc)
    else:
        lib = ctypes.CDLL(so)
        pm = ctypes.cast(lib.gpupool_cupy_malloc, ctypes.c_void_p).value
        pf = ctypes.cast(lib.gpupool_cupy_free, ctypes.c_void_p).value
        cupy.cuda.set_allocator(cupy.cuda.memory.CFunctionAllocator(0, pm, pf, lib).malloc)
    sync = cupy.cuda.Device().synchronize

    def used():
        free, total = rt.memGetInfo()
        return total - free

    rng = random.Random(1234)
    lo, hi = math.log(512), math.log(32 << 20)
    seq = [(rng.randrange(256), int(math.exp(rng.uniform(lo, hi)))) for _ in range(100000)]
    base = used()
    every = int(os.environ.get("TRIM_EVERY", "0"))
    slots, trims, trim_s = [None] * 256, 0, 0.0
    t = time.perf_counter()
    for i, (s, n) in enumerate(seq):
        slots[s] = None
        slots[s] = cupy.empty(n, dtype=cupy.uint8)
        if every and i % every == 0:
            t0 = time.perf_counter()
            rt.memPoolTrimTo(pool, 0)
            trim_s += time.perf_counter() - t0
            trims += 1
    sync()
    dt = time.perf_counter() - t
    live = sum(a.nbytes for a in slots)
    after_loop = used() - base
    rt.memPoolTrimTo(pool, 0)
    sync()
    after_trim = used() - base
    print(json.dumps({
        "config": os.environ.get("CONFIG"), "us_per_step": round(dt / len(seq) * 1e6, 2),
        "trims": trims, "us_per_trim": round(trim_s / trims * 1e6, 1) if trims else None,
        "used_over_live": round(after_loop / live, 3), "after_trim0": round(after_trim / live, 3),
        "driver_pool_reserved_over_live": round(rt.memPoolGetAttribute(pool, ATTR_RESERVED_CURRENT) / live, 3),
        "driver_pool_used_over_live": round(rt.memPoolGetAttribute(pool, ATTR_USED_CURRENT) / live, 3)}), flush=True)


CONFIGS = [
    ("cudaMallocAsync, threshold untouched", "async", {}),
    ("cudaMallocAsync, threshold 0", "async", {"THRESHOLD": "0"}),
    ("cudaMallocAsync, threshold max", "async", {"THRESHOLD": str(2**64 - 1)}),
    ("cudaMallocAsync, threshold 0, trim every 1000 steps", "async", {"THRESHOLD": "0", "TRIM_EVERY": "1000"}),
    ("gpupool async upstream, decay 32768", "gpupool", {"THRESHOLD": "0", "GPUPOOL_UPSTREAM": "async", "GPUPOOL_DECAY": "32768"}),
    ("gpupool async upstream, decay 8192", "gpupool", {"THRESHOLD": "0", "GPUPOOL_UPSTREAM": "async", "GPUPOOL_DECAY": "8192"}),
    ("gpupool async upstream, decay 2048, trim every 2000", "gpupool",
     {"THRESHOLD": "0", "GPUPOOL_UPSTREAM": "async", "GPUPOOL_DECAY": "2048", "TRIM_EVERY": "2000"}),
    ("gpupool device upstream, decay 8192", "gpupool", {"GPUPOOL_DECAY": "8192"}),
]

if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
        sys.exit(0)
    so = sys.argv[1] if len(sys.argv) > 1 else None
    for label, mode, env in CONFIGS:
        if mode == "gpupool" and not so:
            continue
        e = dict(os.environ, CONFIG=label, **env)
        p = subprocess.run([sys.executable, __file__, "--child", mode] + ([so] if so else []),
                           env=e, capture_output=True, text=True, timeout=600)
        out = [l for l in p.stdout.splitlines() if l.startswith("{")]
        print(out[-1] if out else f"{label}: FAILED: {p.stderr.strip().splitlines()[-1:]}", flush=True)
