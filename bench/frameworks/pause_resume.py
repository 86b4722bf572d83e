"""Pause and resume a model's weights with a host backup (docs/tags.md): gpupool's tags
beside torch_memory_saver and the machine's own host-copy bandwidth, one process each.

    python3 bench/frameworks/pause_resume.py GB ROUNDS        # every contender in turn
    python3 bench/frameworks/pause_resume.py GB ROUNDS WHO    # one: copy | gpupool | gpupool-prepared | tms

The weights are bf16 tensors of an LLM's shapes (attention and MLP matrices, norms) adding
up to GB gigabytes, allocated under a tag; each round pauses them with a backup to
page-locked host memory, then resumes them, and checks every tensor's checksum. `copy`
copies one buffer of the same size to and from page-locked host memory: the bandwidth a
pause and a resume can at most reach. Reported: seconds and GB/s of each pause and resume
(the first round apart: it page-locks the host buffer, which later rounds reuse), the
share of the weights' device memory the pause gave back (cudaMemGetInfo), and gpupool's
driver calls in one pause and resume. `gpupool-prepared` page-locks the host buffer ahead
(`gpupool.prepare_backup`, timed apart as `prepare_s`), so its first pause copies at once.
"""
import json
import os
import subprocess
import sys
import time

SHAPES = [(4096, 4096), (4096, 4096), (4096, 4096), (4096, 4096), (4096, 14336), (14336, 4096), (4096, 14336), (4096,), (4096,)]


def weights(torch, total):
    out, n = [], 0
    while n < total:
        for s in SHAPES:
            t = torch.empty(s, dtype=torch.bfloat16, device="cuda")
            t.normal_()
            out.append(t)
            n += t.numel() * 2
    return out


def checksums(torch, ws):
    return torch.stack([w.float().sum() for w in ws]).cpu()


def run_one(who, gb, rounds):
    import torch
    total = int(gb * (1 << 30))
    res = {"who": who, "gb": gb, "pause_s": [], "resume_s": [], "returned": []}
    if who == "copy":
        dev = torch.empty(total, dtype=torch.uint8, device="cuda")
        host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        for _ in range(rounds + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            host.copy_(dev, non_blocking=True)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            res["pause_s"].append(t1 - t0)
            res["resume_s"].append(t2 - t1)
        return res
    if who.startswith("gpupool"):
        import gpupool
        gpupool.torch.install(compiled=True)
        region = lambda: gpupool.tag("weights")
        pause = lambda: gpupool.pause("weights")
        resume = lambda: gpupool.resume("weights")
        calls = lambda: gpupool.stats_json(0)["driver_calls"]
    else:
        from torch_memory_saver import torch_memory_saver as tms
        tms.hook_mode = "torch"
        region = lambda: tms.region(tag="weights", enable_cpu_backup=True)
        pause = lambda: tms.pause("weights")
        resume = lambda: tms.resume("weights")
        res["retain_cpu_backup"] = False
    torch.manual_seed(0)
    with region():
        ws = weights(torch, total)
    if who == "tms":
        # Keep the host backup between rounds, as gpupool does (fair steady state).
        try:
            tms.retain_cpu_backup = True
            res["retain_cpu_backup"] = True
        except Exception as e:  # older releases have no such switch
            res["retain_cpu_backup"] = f"unavailable: {e}"
    if who == "gpupool-prepared":
        t = time.perf_counter()
        res["prepared_bytes"] = gpupool.prepare_backup("weights")
        res["prepare_s"] = time.perf_counter() - t
    want = checksums(torch, ws)
    size = sum(w.numel() * 2 for w in ws)
    res["bytes"] = size
    for _ in range(rounds + 1):
        torch.cuda.synchronize()
        if who.startswith("gpupool"):
            c0 = calls()
        free0 = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        pause()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        free1 = torch.cuda.mem_get_info()[0]
        resume()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        res["pause_s"].append(t1 - t0)
        res["resume_s"].append(t2 - t1)
        res["returned"].append((free1 - free0) / size)
        if who.startswith("gpupool"):
            c1 = calls()
            res["calls"] = {k: c1[k] - c0[k] for k in ("mem_create", "mem_map", "mem_unmap", "set_access", "total") if c1[k] != c0[k]}
        got = checksums(torch, ws)
        if not torch.equal(got, want):
            raise SystemExit(f"{who}: the weights changed across a pause")
    return res


def table(results):
    print(f"| who | GB | first pause s | first resume s | pause s (median) | resume s (median) | pause GB/s | resume GB/s | returned |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['who']} | {r['gb']} | {r['error'][:80]} |")
            continue
        med = lambda v: sorted(v)[len(v) // 2]
        p, q = med(r["pause_s"][1:]), med(r["resume_s"][1:])
        gbytes = r.get("bytes", int(r["gb"] * (1 << 30))) / 1e9
        ret = f"{min(r['returned']):.3f}" if r["returned"] else "-"
        print(f"| {r['who']} | {r['gb']} | {r['pause_s'][0]:.3f} | {r['resume_s'][0]:.3f} | {p:.3f} | {q:.3f} | {gbytes / p:.1f} | {gbytes / q:.1f} | {ret} |")
    for r in results:
        if r.get("calls"):
            print(f"{r['who']}: driver calls in the last pause + resume: {r['calls']}")


def main():
    gb, rounds = float(sys.argv[1]), int(sys.argv[2])
    if len(sys.argv) > 3:
        print(json.dumps(run_one(sys.argv[3], gb, rounds)))
        return
    results = []
    for who in ("copy", "gpupool", "gpupool-prepared", "tms"):
        p = subprocess.run([sys.executable, __file__, str(gb), str(rounds), who], capture_output=True, text=True)
        line = (p.stdout.strip().splitlines() or [""])[-1]
        try:
            results.append(json.loads(line))
        except ValueError:
            results.append({"who": who, "gb": gb, "error": (p.stderr.strip().splitlines() or ["?"])[-1]})
        print(who, p.returncode, line[:300], file=sys.stderr)
    table(results)


if __name__ == "__main__":
    main()
