"""How many physical allocations share_check.py's producer's tensors lie in under the arena,
by GPUPOOL_ARENA_CHUNK_FROM (CPU, host upstream): the receiver imports each allocation under
a sent block, at about 70 us of driver time each on an H200 (session 36, run b), so this
count is its import work. The producer's sequence is replayed as PyTorch makes it:
`(torch.arange(E, int64) * 7 + i) % 97` then `.to(dtype)` (each temporary freed once the
next exists), every tensor kept. Prints, per threshold: allocations under the kept tensors
(granules + chunks; the exported extents' allocations, counted once each), the allocations
mapped, and peak mapped over the peak in use.

    GPUPOOL_LIBRARY=... python3 share_layout.py [TENSORS] [MAX_MIB]
"""
import ctypes, json, math, os, random, subprocess, sys

DTYPE_BYTES = [4, 2, 1, 8]  # float32, bfloat16, uint8, int64, as share_check.py cycles them


def run(chunk_from, n, max_bytes):
    import gpupool
    if chunk_from:
        os.environ["GPUPOOL_ARENA_CHUNK_FROM"] = chunk_from
    gpupool.configure(0, pool="arena", upstream="host")
    L = gpupool.lib()

    def alloc(size):
        p = ctypes.c_void_p()
        assert L.gpupool_malloc(ctypes.byref(p), size, 0, None) == 0
        return p.value

    def free(p):
        assert L.gpupool_free(ctypes.c_void_p(p), 0, None) == 0

    rng = random.Random(1)
    kept = []
    for i in range(n):
        es = DTYPE_BYTES[i % 4]
        nbytes = int(math.exp(rng.uniform(math.log(256), math.log(max_bytes))))
        elems = max(8, nbytes // es)
        t1 = alloc(8 * elems)          # arange
        t2 = alloc(8 * elems); free(t1)  # * 7
        t3 = alloc(8 * elems); free(t2)  # + i
        t4 = alloc(8 * elems); free(t3)  # % 97
        if es == 8:
            kept.append((t4, 8 * elems))  # .to(int64) is the same tensor
        else:
            kept.append((alloc(es * elems), es * elems)); free(t4)
    s = gpupool.stats_json(0)
    a = s["arena"]
    g = a["granule"]
    # The allocations under the kept blocks: a chunk's granules count once.
    allocs = set()
    chunk_of = {}
    for p, size in kept:
        first = p - p % g
        for gr in range(first, p + size, g):
            allocs.add(gr)
    mapped_allocs = a["chunks"] + a["granules_mapped"] - a["chunk_bytes"] // g
    return {"chunk_from": chunk_from or "64MiB (default)", "allocations_mapped": mapped_allocs, "chunks": a["chunks"],
            "granules_under_kept": len(allocs), "peak_mapped_over_peak_in_use": round(s["peak_total_bytes"] / s["peak_used_bytes"], 4)}


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        print(json.dumps(run(sys.argv[2] if sys.argv[2] != "-" else None, int(sys.argv[3]), int(sys.argv[4]) << 20)))
        sys.exit(0)
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    most = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    for cf in ["-", "32MiB", "16MiB", "8MiB"]:
        out = subprocess.run([sys.executable, __file__, "--one", cf, str(n), str(most)], capture_output=True, text=True)
        print(out.stdout.strip() or out.stderr[-500:])
