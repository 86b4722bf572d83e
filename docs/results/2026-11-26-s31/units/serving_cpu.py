"""Serving's process CPU time beside its wall time, native and arena alternating: whether the
arena's slower serving rounds spend more CPU (host work: the allocator, PyTorch's path to it)
or wait longer for the GPU. One process per run (bench_workloads.py run serving ALLOCATOR),
its children's user and system time from getrusage.
    GPUPOOL_LIBRARY=dist/libgpupool.so python3 docs/results/2026-11-26-s31/units/serving_cpu.py ROUNDS"""
import json
import os
import resource
import subprocess
import sys

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 2
for r in range(1, rounds + 1):
    for a in ("native", "arena"):
        env = dict(os.environ)
        env.pop("GPUPOOL_POOL", None)
        if a == "arena":
            env["GPUPOOL_POOL"] = "arena"
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        out = subprocess.run([sys.executable, "scripts/bench_workloads.py", "run", "serving", a], env=env,
                             capture_output=True, text=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        line = [l for l in out.stdout.splitlines() if l.startswith("{")]
        if not line:
            print(a, "no result", out.stderr[-400:])
            continue
        res = json.loads(line[-1])
        user, sys_ = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
        print(json.dumps({"round": r, "allocator": a, "tokens_per_s": round(res["tokens_per_s"], 1),
                          "measured_s": round(sum(res["step_ms_by_step"]) / 1e3, 2), "wall_s": round(res["wall_s"], 2),
                          "cpu_user_s": round(user, 2), "cpu_sys_s": round(sys_, 2),
                          "vol_ctx_switches": after.ru_nvcsw - before.ru_nvcsw,
                          "fingerprint": res["fingerprint_sha256"]}), flush=True)
