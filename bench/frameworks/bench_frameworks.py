"""Run the framework churn benchmark (bench/frameworks/churn.py) for every allocator in one GPU
run and print the table with ratios against the anchors measured in the same run.

usage: python3 bench/frameworks/bench_frameworks.py BENCH_DIR LIBGPUPOOL PASSTHROUGH_SO CHURN_FLOOR_SO [OUT_JSONL]
Each allocator runs in its own process (one allocator per process, as churn.py requires).
CHURN_FLOOR_SO: bench/gpu/churn_floor.c built, the `churn` workload's floor (distinct
addresses at next to no cost; bench/frameworks' floor plug-in serves `fixed` only).
"""
import json
import os
import subprocess
import sys

bench, gp, pt, cf = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
out_path = sys.argv[5] if len(sys.argv) > 5 else None
churn = os.path.join(bench, "churn.py")

# gpupool configurations: (name, label in the table, environment).
GPUPOOL_CONFIGS = [
    ("gpupool", "default (device, decay off)", {}),
    ("gpupool-notc", "default without the thread cache", {"GPUPOOL_THREAD_CACHE": "0"}),
    ("gpupool-vmm", "vmm, decay 8192", {"GPUPOOL_UPSTREAM": "vmm", "GPUPOOL_DECAY": "8192"}),
    ("gpupool-decay32k", "device, decay 32768", {"GPUPOOL_DECAY": "32768"}),
    ("gpupool-decay8k", "device, decay 8192", {"GPUPOOL_DECAY": "8192"}),
    ("gpupool-async", "async (segments from the driver's pool), decay 32768", {"GPUPOOL_UPSTREAM": "async", "GPUPOOL_DECAY": "32768"}),
]
PLUGIN = {"torch": ["torch-plugin", gp, "gpupool_torch_malloc", "gpupool_torch_free"],
          "cupy": ["cupy-cfunc", gp, "gpupool_cupy_malloc", "gpupool_cupy_free"]}

# Within a round the anchors run right next to gpupool (native, floors, gpupool variants,
# then async and RMM), so the paired table below compares runs minutes apart at most.
def _runs(fw, native, floor, churn_floor, others):
    return ([(fw, "native", native[0], native[1]), (fw, "floor", floor, {"ONLY": "fixed"}),
             (fw, "churn-floor", churn_floor, {"ONLY": "churn"})]
            + [(fw, name, PLUGIN[fw], env) for name, _, env in GPUPOOL_CONFIGS] + others)


RUNS = _runs("torch", (["torch-native"], {}), ["torch-plugin", pt, "floor_malloc", "floor_free"],
             ["torch-plugin", cf, "cf_malloc", "cf_free"],
             [("torch", "async", ["torch-async"], {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}),
              ("torch", "rmm", ["torch-rmm"], {})]) + \
       _runs("cupy", (["cupy-native"], {}), ["cupy-cfunc", pt, "floor_cupy_malloc", "floor_cupy_free"],
             ["cupy-cfunc", cf, "cf_cupy_malloc", "cf_cupy_free"],
             [("cupy", "async", ["cupy-async"], {}), ("cupy", "rmm", ["cupy-rmm"], {})])

# ALLOCATORS=native,floor,gpupool,... runs a subset (the anchors native and floor should stay);
# FRAMEWORKS=torch or cupy one framework (a full run of both passes the GPU machine's
# 10-minute limit per command).
_only = os.environ.get("ALLOCATORS")
if _only:
    RUNS = [r for r in RUNS if r[1] in _only.split(",")]
_fws = os.environ.get("FRAMEWORKS")
if _fws:
    RUNS = [r for r in RUNS if r[0] in _fws.split(",")]

# Timings on a shared machine drift by tens of percent between minutes; so every allocator
# runs ROUNDS times, interleaved (round 1 of all, then round 2 of all, ...), and each cell
# is the median over rounds.
rounds = int(os.environ.get("ROUNDS", "3"))
samples = {}
lines = []
for rnd in range(rounds):
    for fw, name, args, env in RUNS:
        e = dict(os.environ, **env)
        p = subprocess.run([sys.executable, churn] + args, env=e, capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            print(f"{fw}/{name}: FAILED ({p.returncode}): {p.stderr.strip().splitlines()[-1:]}", flush=True)
            continue
        for line in p.stdout.splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                samples.setdefault((fw, name, r["work"]), []).append(r)
                lines.append(dict(r, framework=fw, allocator=name, round=rnd))
                print(f"round {rnd} {fw}/{name}: {line}", flush=True)
by_median, by_min = {}, {}
for k, rs in samples.items():
    rs = sorted(rs, key=lambda r: r["us_per_pair"])
    by_median[k] = rs[len(rs) // 2]
    by_min[k] = rs[0]
if out_path:
    with open(out_path, "w") as f:
        for l in lines:
            f.write(json.dumps(l) + "\n")


def cell(results, fw, name, work, key="us_per_pair"):
    r = results.get((fw, name, work))
    return None if r is None else r[key]


def fmt(v, nd=2):
    return "—" if v is None else f"{v:.{nd}f}"


GPUPOOL_VARIANTS = [n for n in dict.fromkeys(r[1] for r in RUNS) if n.startswith("gpupool")]
UPSTREAM_OF = {name: label for name, label, _ in GPUPOOL_CONFIGS}


def table(results, title):
    print()
    print(title)
    print("| framework | workload | native | async | RMM | floor | gpupool variant | gpupool | target | met |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("(floor for churn: bench/gpu/churn_floor.c, an allocator that costs next to nothing)")
    for fw in ("torch", "cupy"):
        if not any(k[0] == fw for k in results):
            continue
        for gpn in GPUPOOL_VARIANTS:
            names = ("native", "async", "rmm", "floor", gpn)
            fixed = {n: cell(results, fw, n, "fixed") for n in names}
            churnv = {n: cell(results, fw, n, "churn") for n in names}
            churnv["floor"] = cell(results, fw, "churn-floor", "churn")
            label = UPSTREAM_OF.get(gpn, gpn)
            t_fixed = None if fixed["floor"] is None else fixed["floor"] + 0.15
            met = "—" if None in (t_fixed, fixed[gpn]) else ("yes" if fixed[gpn] <= t_fixed else "no")
            print(f"| {fw} | fixed µs/pair | {fmt(fixed['native'])} | {fmt(fixed['async'])} | {fmt(fixed['rmm'])} | {fmt(fixed['floor'])} | "
                  f"{label} | {fmt(fixed[gpn])} | ≤ floor+0.15 = {fmt(t_fixed)} | {met} |")
            t_churn = None if churnv["native"] is None else 0.9 * churnv["native"]
            met = "—" if None in (t_churn, churnv[gpn]) else ("yes" if churnv[gpn] <= t_churn else "no")
            ratio = None if None in (churnv["native"], churnv[gpn]) else churnv[gpn] / churnv["native"]
            print(f"| {fw} | churn µs/pair | {fmt(churnv['native'])} | {fmt(churnv['async'])} | {fmt(churnv['rmm'])} | {fmt(churnv['floor'])} | "
                  f"{label} | {fmt(churnv[gpn])} (×{fmt(ratio)} native) | ≤ 0.9 × native = {fmt(t_churn)} | {met} |")
            # RMM reserves its pool before churn.py reads its baseline: no comparable figure.
            used = {"rmm": None}
            for n in ("native", "async", gpn):
                r = results.get((fw, n, "churn"))
                used[n] = None if r is None or not r["live_MiB"] else r["device_used_delta_MiB"] / r["live_MiB"]
            met = "—" if used[gpn] is None else ("yes" if used[gpn] <= 1.15 else "no")
            print(f"| {fw} | churn device used / live | {fmt(used['native'])} | {fmt(used['async'])} | {fmt(used['rmm'])} | — | "
                  f"{label} | {fmt(used[gpn])} | ≤ 1.15 | {met} |")


table(by_median, f"median of {rounds} interleaved rounds:")
table(by_min, f"best of {rounds} interleaved rounds (least disturbed by other load):")


def paired():
    """Per round, gpupool against the anchors of the same round (fixed: minus the floor; churn:
    over native), median over rounds and the rounds that met the target. On a loaded host the
    rounds drift together, so this is the steadiest reading of the targets."""
    by_round = {}
    for l in lines:
        by_round[(l["framework"], l["allocator"], l["work"], l["round"])] = l["us_per_pair"]
    print()
    print(f"paired by round ({rounds} rounds): median of the per-round figure, rounds meeting the target")
    print("| framework | gpupool variant | fixed − floor (µs) | met | churn / native | met |")
    print("|---|---|---|---|---|---|")
    for fw in ("torch", "cupy"):
        for gpn in GPUPOOL_VARIANTS:
            d = [by_round[(fw, gpn, "fixed", r)] - by_round[(fw, "floor", "fixed", r)] for r in range(rounds)
                 if (fw, gpn, "fixed", r) in by_round and (fw, "floor", "fixed", r) in by_round]
            q = [by_round[(fw, gpn, "churn", r)] / by_round[(fw, "native", "churn", r)] for r in range(rounds)
                 if (fw, gpn, "churn", r) in by_round and (fw, "native", "churn", r) in by_round]
            if not d and not q:
                continue
            med = lambda v: sorted(v)[len(v) // 2] if v else None
            fd, fq = med(d), med(q)
            print(f"| {fw} | {UPSTREAM_OF.get(gpn, gpn)} | {fmt(fd)} | "
                  f"{'—' if fd is None else ('yes' if fd <= 0.15 else 'no')} ({sum(x <= 0.15 for x in d)}/{len(d)}) | "
                  f"×{fmt(fq)} | {'—' if fq is None else ('yes' if fq <= 0.9 else 'no')} ({sum(x <= 0.9 for x in q)}/{len(q)}) |")


paired()
