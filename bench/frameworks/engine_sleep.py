"""Put a whole serving engine to sleep and wake it (docs/tags.md): gpupool beside
torch_memory_saver, one process each.

    python3 bench/frameworks/engine_sleep.py [CYCLES]            # every contender in turn
    python3 bench/frameworks/engine_sleep.py CYCLES WHO          # one: gpupool | tms

The engine, made as each allocator's docs say: weights (8 MLP layers of hidden size 4096,
bf16, 2 GiB, backed up), a KV cache (4 GiB, not backed up), a workspace (512 MiB, backed up;
a `MemPool` under gpupool, a region under torch_memory_saver), and decode graphs captured
for batch sizes 1, 8, 32 and 128. Each cycle pauses everything, reads the device memory
the process still holds (cudaMemGetInfo, less the CUDA context measured before the engine
was made), and resumes; every tenth cycle and the last replay every graph and compare its
output with the output before the first pause (bit for bit). Reported: the engine's bytes,
the most held while paused (and its share of the engine), pause and resume seconds (first
apart, then the median), and whether every output matched.
"""
import json
import os
import statistics
import subprocess
import sys
import time

HIDDEN, LAYERS, BATCHES = 4096, 8, (1, 8, 32, 128)
KV_BYTES, WORKSPACE_BYTES = 4 << 30, 512 << 20


def decode_with(layers, x, ws):
    for w1, w2 in layers:
        x = x + __import__("torch").relu(x @ w1) @ w2
    return x.float().softmax(-1) + ws[:HIDDEN]


def context_bytes(torch, release):
    """The process's device memory with the engine's kernels and libraries loaded and
    nothing allocated: a decode of every batch size on two streams, then everything freed,
    cuBLAS's workspaces included, and the cache given back (`release`)."""
    layer = [(torch.zeros(HIDDEN, 4 * HIDDEN, device="cuda", dtype=torch.bfloat16),
              torch.zeros(4 * HIDDEN, HIDDEN, device="cuda", dtype=torch.bfloat16))]
    ws = torch.zeros(HIDDEN, device="cuda")
    side = torch.cuda.Stream()
    for s in (torch.cuda.current_stream(), side):
        with torch.cuda.stream(s):
            for b in BATCHES:
                decode_with(layer, torch.zeros(b, HIDDEN, device="cuda", dtype=torch.bfloat16), ws)
    torch.cuda.synchronize()
    del layer, ws
    torch._C._cuda_clearCublasWorkspaces()
    release()
    free, total = torch.cuda.mem_get_info()
    return total - free, total


def run_one(who, cycles):
    import torch
    if who == "gpupool":
        import gpupool
        gpupool.torch.install(compiled=True)
        region = lambda tag, backup: gpupool.tag(tag)
        pause = lambda: gpupool.pause(backup={"kv": False, "graphs": False})
        resume = lambda: gpupool.resume()
        release = gpupool.reclaim
    else:
        from torch_memory_saver import torch_memory_saver as tms
        region = lambda tag, backup: tms.region(tag=tag, enable_cpu_backup=backup)
        pause = lambda: tms.pause()
        resume = lambda: tms.resume()
        release = torch.cuda.empty_cache
    torch.manual_seed(0)
    context, total = context_bytes(torch, release)
    with region("weights", True):
        layers = [(torch.randn(HIDDEN, 4 * HIDDEN, device="cuda", dtype=torch.bfloat16) / 64,
                   torch.randn(4 * HIDDEN, HIDDEN, device="cuda", dtype=torch.bfloat16) / 128) for _ in range(LAYERS)]
        static_in = {b: torch.randn(b, HIDDEN, device="cuda", dtype=torch.bfloat16) for b in BATCHES}
    with region("kv", False):
        kv = torch.zeros(KV_BYTES // 2, device="cuda", dtype=torch.bfloat16)
    if who == "gpupool":
        with region("workspace", True):
            pool = torch.cuda.MemPool()
            with torch.cuda.use_mem_pool(pool):
                ws = torch.ones(WORKSPACE_BYTES // 4, device="cuda")
    else:
        with region("workspace", True):
            ws = torch.ones(WORKSPACE_BYTES // 4, device="cuda")

    decode = lambda x: decode_with(layers, x, ws)

    graphs, outs = {}, {}
    with region("graphs", False):
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            for b in BATCHES:
                decode(static_in[b])         # warm-up: cuBLAS's workspace, made here too
        torch.cuda.synchronize()
        for b in BATCHES:
            graphs[b] = torch.cuda.CUDAGraph()
            capture = torch.cuda.graph(graphs[b]) if who == "gpupool" else tms.cuda_graph(graphs[b], tag="graphs")
            with capture:
                outs[b] = decode(static_in[b])

    def replay():
        for b in BATCHES:
            graphs[b].replay()
        torch.cuda.synchronize()
        return {b: outs[b].clone() for b in BATCHES}

    want = replay()
    free, _ = torch.cuda.mem_get_info()
    engine = total - free - context
    res = {"who": who, "engine_bytes": engine, "context_bytes": context, "max_allocated": torch.cuda.max_memory_allocated(),
           "pause_s": [], "resume_s": [], "held_paused": [], "identical": True}
    for cycle in range(cycles):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pause()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        free, _ = torch.cuda.mem_get_info()
        res["held_paused"].append(total - free - context)
        if who == "gpupool":
            # What gpupool itself still maps (the rest is the driver's and libraries').
            j = gpupool.stats_json(0)
            res.setdefault("gpupool_mapped_paused", []).append(j["total_bytes"] - sum(t["paused_bytes"] for t in j["tags"].values()))
        t2 = time.perf_counter()
        resume()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        res["pause_s"].append(t1 - t0)
        res["resume_s"].append(t3 - t2)
        if cycle % 10 == 0 or cycle == cycles - 1:
            got = replay()
            res["identical"] &= all(torch.equal(got[b], want[b]) for b in BATCHES)
    return res


def table(results):
    print("| who | engine GiB | held while paused, MiB (share of the engine) | first pause s | first resume s | pause s (median) | resume s (median) | outputs identical |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['who']} | {r['error'][:120]} |")
            continue
        worst = r["held_paused_range"][1]
        print(f"| {r['who']} | {r['engine_bytes'] / (1 << 30):.2f} | {worst / (1 << 20):.0f} ({100 * worst / r['engine_bytes']:.2f} %) "
              f"| {r['pause_s'][0]:.3f} | {r['resume_s'][0]:.3f} | {statistics.median(r['pause_s'][1:] or r['pause_s']):.3f} "
              f"| {statistics.median(r['resume_s'][1:] or r['resume_s']):.3f} | {r['identical']} |")


def main():
    cycles = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    if len(sys.argv) > 2:
        r = run_one(sys.argv[2], cycles)
        r["held_paused_range"] = [min(r["held_paused"]), max(r["held_paused"])]
        r["held_paused"] = r["held_paused"][:3]
        if "gpupool_mapped_paused" in r:
            r["gpupool_mapped_paused"] = max(r["gpupool_mapped_paused"])
        print(json.dumps(r))
        return
    results = []
    for who in ("gpupool", "tms"):
        env = dict(os.environ)
        if who == "tms":
            # torch_memory_saver releases graph memory only with its preload hook.
            try:
                from torch_memory_saver.utils import get_binary_path_from_package
                env["LD_PRELOAD"] = str(get_binary_path_from_package("torch_memory_saver_hook_mode_preload"))
            except Exception as e:
                results.append({"who": who, "error": f"torch_memory_saver unavailable: {e}"})
                continue
        p = subprocess.run([sys.executable, __file__, str(cycles), who], capture_output=True, text=True, env=env)
        line = (p.stdout.strip().splitlines() or [""])[-1]
        try:
            results.append(json.loads(line))
        except ValueError:
            results.append({"who": who, "error": (p.stderr.strip().splitlines() or ["?"])[-1]})
            print(p.stderr[-3000:], file=sys.stderr)
        print(who, p.returncode, line[:400], file=sys.stderr)
    table(results)


if __name__ == "__main__":
    main()
