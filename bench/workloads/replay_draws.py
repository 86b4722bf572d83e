#!/usr/bin/env python3
"""Replay every recorded draw of the workload benchmark through one pool, on the CPU: the
figures a policy change must be judged on, in seconds.

    cargo build --release
    python3 bench/workloads/replay_draws.py [--pool arena] [--replay target/release/gpupool-replay] [--churn-draws 9]

One draw of a workload whose shapes never repeat is chance layout (docs/arena.md, "One draw
is chance"), so this replays, per workload, every draw there is:
  - tokens, training, serving: the GPUPOOL_TRACE recordings of bench/workloads/bench_workloads.py
    on an H200 (tests/data/draws/: draw 0 and BENCH_SEED 1-3), decompressed into a
    temporary folder;
  - churn: generated here as bench/workloads/workloads.py draws it, after the 4-byte allocation of
    bench_workloads.py's first kernel (BENCH_SEED 0-8, or 0..N-1 with --churn-draws N;
    draw 0 replays as the GPU's recording of it does).
It prints, per draw, peak reserved / peak in use, the driver calls of the trace's second
half and their kinds (gpupool-replay's figures), then each workload's worst ratio and mean
calls. Churn's trace has a fixed number of events a step, so its draws also get the benchmark's
own figure, as the GPU benchmark counts it: driver calls a step over the second half
of the measured steps, steps that reach a new peak of bytes in use excepted
(`gpupool-replay --steps`); the recorded traces carry no step marks.
"""
import argparse
import lzma
import math
import os
import random
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECORDED = [
    ("tokens", 0, "tests/data/draws/tokens.csv.xz"),
    ("tokens", 1, "tests/data/draws/tokens-seed1.csv.xz"),
    ("training", 0, "tests/data/draws/training.csv.xz"),
    ("training", 1, "tests/data/draws/training-seed1.csv.xz"),
    ("serving", 0, "tests/data/draws/serving.csv.xz"),
] + [("serving", s, f"tests/data/draws/serving-seed{s}.csv.xz") for s in (1, 2, 3)]
CHURN_DRAWS = 9  # the default; --churn-draws N for more (a policy's churn figure is judged on 39)
EXTRA = []  # gpupool-replay's flags beyond --pool and --steps (main sets them)


CHURN = dict(slots=256, ops=1000, warmup=5, steps=30)  # bench_workloads.py's churn


def churn_steps():
    """gpupool-replay's --steps for churn_trace: the two events of the first kernel and the
    slots' first allocations, then a free and an alloc per op."""
    return f"{2 + CHURN['slots']},{2 * CHURN['ops']},{CHURN['warmup']}"


def churn_trace(seed, path, slots=CHURN["slots"], ops=CHURN["ops"], steps=CHURN["warmup"] + CHURN["steps"], lo=512, hi=32 << 20):
    """bench/workloads/workloads.py's churn (its config in bench_workloads.py), as trace rows."""
    rng, llo, lhi = random.Random(1234 + seed), math.log(lo), math.log(hi)
    rows, t, ptr = ["time_ns,thread,device,stream,action,ptr,size"], 0, 0

    def alloc():
        nonlocal t, ptr
        n = int(math.exp(rng.uniform(llo, lhi)))
        t, ptr = t + 1, ptr + 0x1000
        rows.append(f"{t},1,0,0x0,alloc,{ptr:#x},{n}")
        return ptr, n

    def free(b):
        nonlocal t
        t += 1
        rows.append(f"{t},1,0,0x0,free,{b[0]:#x},{b[1]}")

    # bench_workloads.py's first kernel (`torch.ones(1).add_(1)`) allocates 4 bytes and
    # frees them before the workload: one allocation that moves where everything lands.
    rows.append("1,1,0,0x0,alloc,0x1,4")
    rows.append("2,1,0,0x0,free,0x1,4")
    t = 2
    live = [alloc() for _ in range(slots)]
    for _ in range(steps * ops):
        i = rng.randrange(slots)
        free(live[i])
        live[i] = alloc()
    for b in reversed(live):  # the list dies last item first
        free(b)
    with open(path, "w") as f:
        f.write("\n".join(rows) + "\n")


def replay(tool, pool, path, steps=None):
    out = subprocess.run([tool, path, "--pool", pool] + (["--steps", steps] if steps else []) + EXTRA, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{tool} {path}: {out.stderr.strip()}")
    row = next(l for l in out.stdout.splitlines() if l.startswith(f"| {pool} |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    ratio = float(cells[3])
    second = int(cells[10].split("/")[1])
    kinds = re.search(rf"{pool}: ([^;\n]*)", out.stdout.split("driver calls by kind:")[-1]) if second else None
    per_step = "-"
    if steps:
        m = re.search(rf"^{pool} steps: \d+ measured; second half [\d.]+ driver calls a step, ([\d.]+) off peak \((\d+) new-peak", out.stdout, re.M)
        per_step = f"{float(m.group(1)):.2f} ({m.group(2)})"
    return ratio, second, kinds.group(1).strip() if kinds else "none", per_step


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pool", default="arena", choices=("arena", "split", "binned", "none"))
    ap.add_argument("--replay", default=os.path.join(ROOT, "target", "release", "gpupool-replay"))
    ap.add_argument("--churn-draws", type=int, default=CHURN_DRAWS, help="churn draws to generate (BENCH_SEED 0..N-1)")
    ap.add_argument("--arena-piece-ends", action="store_true", help="gpupool-replay's --arena-piece-ends (GPUPOOL_ARENA_PIECE_ENDS=1)")
    ap.add_argument("--arena-chunk-from", metavar="SIZE", help="gpupool-replay's --arena-chunk-from (GPUPOOL_ARENA_CHUNK_FROM)")
    a = ap.parse_args()
    EXTRA.extend(["--arena-piece-ends"] if a.arena_piece_ends else [])
    EXTRA.extend(["--arena-chunk-from", a.arena_chunk_from] if a.arena_chunk_from else [])
    if a.churn_draws < 0:
        ap.error("--churn-draws must be 0 or more")
    if not os.access(a.replay, os.X_OK):
        sys.exit(f"no replay tool at {a.replay}: build it first (cargo build --release)")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, draw, rel in RECORDED:
            path = os.path.join(tmp, f"{name}-{draw}.csv")
            with lzma.open(os.path.join(ROOT, rel), "rb") as src, open(path, "wb") as dst:
                dst.write(src.read())
            results.append((name, draw, *replay(a.replay, a.pool, path)))
            os.remove(path)
        for draw in range(a.churn_draws):
            path = os.path.join(tmp, f"churn-{draw}.csv")
            churn_trace(draw, path)
            results.append(("churn", draw, *replay(a.replay, a.pool, path, churn_steps())))
    print(f"| workload | draw | peak reserved / peak in use | driver calls, second half | a step off peak (new-peak steps) | their kinds ({a.pool}) |")
    print("|---|---|---|---|---|---|")
    for name, draw, ratio, calls, kinds, per_step in results:
        print(f"| {name} | {draw} | {ratio:.3f} | {calls} | {per_step} | {kinds} |")
    print()
    for name in dict.fromkeys(r[0] for r in results):
        mine = [r for r in results if r[0] == name]
        line = (f"{name}: worst {max(r[2] for r in mine):.3f}, calls {sum(r[3] for r in mine) / len(mine):.0f} a draw "
                f"(most {max(r[3] for r in mine)}) over {len(mine)} draws")
        steps = [float(r[5].split()[0]) for r in mine if r[5] != "-"]
        if steps:
            line += f"; a step off peak: mean {sum(steps) / len(steps):.2f}, most {max(steps):.2f}"
        print(line)


if __name__ == "__main__":
    main()
