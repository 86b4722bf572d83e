"""The churn workload's sequence (scripts/workloads.py, BENCH_SEED 0) through gpupool's C API
directly (ctypes, no PyTorch), on the device's legacy stream: what the library itself costs
per free + malloc pair in a GPU process, for the pool GPUPOOL_POOL names. Also the driver
calls over the timed pass (gpupool_stats_json), to tell growth from bookkeeping.
    GPUPOOL_LIBRARY=dist/libgpupool.so GPUPOOL_POOL=arena python3 churn_direct.py"""
import ctypes, json, math, os, random, time

L = ctypes.CDLL(os.environ["GPUPOOL_LIBRARY"])
L.gpupool_malloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
L.gpupool_free.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
L.gpupool_stats_json.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
L.gpupool_stats_json.restype = ctypes.c_size_t


def calls():
    buf = ctypes.create_string_buffer(1 << 20)
    n = L.gpupool_stats_json(0, buf, len(buf))
    s = json.loads(buf.value[:n].decode())
    s = s[0] if isinstance(s, list) else s
    return s["driver_calls"]["total"]


rng, lo, hi = random.Random(1234), math.log(512), math.log(32 << 20)
size = lambda: int(math.exp(rng.uniform(lo, hi)))
slots = []
for _ in range(256):
    p = ctypes.c_void_p()
    assert L.gpupool_malloc(ctypes.byref(p), size(), 0, None) == 0
    slots.append(p)


def run(n):
    t = 0.0
    for _ in range(n):
        i, sz = rng.randrange(256), size()
        t0 = time.perf_counter()
        L.gpupool_free(slots[i], 0, None)
        L.gpupool_malloc(ctypes.byref(slots[i]), sz, 0, None)
        t += time.perf_counter() - t0
    return t / n * 1e6


run(5000)
c0 = calls()
us = [round(run(20000), 3) for _ in range(3)]
print(json.dumps({"pool": os.environ.get("GPUPOOL_POOL", "default"), "us_per_pair": us, "driver_calls": calls() - c0}))
