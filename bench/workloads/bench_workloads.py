"""Memory efficiency and speed of CUDA allocators on realistic PyTorch workloads.

usage:
    python3 bench/workloads/bench_workloads.py run WORKLOAD ALLOCATOR
        one workload with one allocator in this process; prints one JSON line on stdout
        (progress goes to stderr).
    python3 bench/workloads/bench_workloads.py all [--workloads training,serving,churn]
                                           [--allocators native,expandable,rmm,split,arena]
                                           [--rounds N] [--out FILE.jsonl]
        one fresh process per (workload, allocator) (an allocator must be chosen before
        PyTorch touches the GPU); prints a markdown table per workload, then whether all
        allocators produced identical outputs. --rounds N runs every workload N times, the
        allocators in turn within each round; speed columns are then the median of the
        rounds (the range in "rounds"), memory columns the first round's (they repeat).

Workloads: training (transformer, random sequence length per step, AdamW), tokens (the
same model with token-budget batching: a new sequence length and batch size every step,
bf16 autocast, no warm-up at the longest shape), serving
(incremental decoding, per-request KV caches grown with torch.cat), churn (256 live
buffers, random free + log-uniform random allocation).
Allocators: native (PyTorch default), expandable (expandable_segments:True), rmm (RMM pool
through rmm_torch_allocator), split / arena (gpupool with GPUPOOL_POOL=split / arena;
GPUPOOL_LIBRARY names the library).

Environment: BENCH_STEPS overrides the number of measured steps (serving: measured decoding
iterations, the run stops there); BENCH_QUICK=1 makes every workload tiny (smoke run); BENCH_SEED=N
draws other shapes, sizes and arrivals (0, the default: the recorded ones);
BENCH_RMM_INITIAL_POOL sets RMM's initial pool size (default: RMM's own, half the free
device memory, which then counts as reserved).

Columns:
  step ms       median wall time of a measured step (synchronized before and after)
  vs native     step ms / native's step ms in the same table
  peak alloc    peak bytes handed out to tensors over the whole run, warm-up included
                (native/expandable: max_memory_allocated; gpupool: peak_used_bytes;
                rmm: a statistics adaptor over the pool)
  peak rsrvd    peak bytes the allocator held from the driver (native/expandable:
                max_memory_reserved; gpupool: peak_total_bytes; rmm: a statistics
                adaptor under the pool, else peak dev used)
  rsrvd/alloc   peak rsrvd / peak alloc (1.00 = no waste), as each allocator counts allocated
  rsrvd/requested  peak rsrvd / the peak of bytes the program asked for, the same measure for
                every allocator (PyTorch's requested_bytes, RMM's adaptor, gpupool's
                peak_requested_bytes; PyTorch counts blocks it did not split whole as
                allocated, gpupool's split too, the arena rounds to 512 B: rsrvd/alloc)
  peak dev used device memory in use by the process (total - free from cudaMemGetInfo),
                sampled after every step and inside steps (training: after the forward
                pass; churn: every 250 ops), minus the same figure right after CUDA
                context creation: the cross-check valid for every allocator
  allocs+frees  device memory allocations + releases per measured step (native/expandable:
                memory_stats num_device_alloc + num_device_free; gpupool: upstream
                allocs + frees; rmm: cudaMalloc/cudaFree under the pool)
  driver/step   gpupool only: driver calls per measured step (stats_json driver_calls.total)
  2nd half/step the same, mean over the second half of the measured steps (the steady state)
  2nd half off peak  the same over the second half's steps that did not reach a new peak of
                bytes handed out (the steady state excepts those: growth to hold more), and in
                parentheses how many did ("-": no peak reported, or every step reached one)
  steps calling measured steps that made a driver call (gpupool) or a device allocation or
                free (the others): growth at a new peak, apart from a steady state
  tokens/s      serving only: tokens generated in measured iterations / their time
  host launch us  serving only: the process's mean time to launch a small kernel, measured
                once after warm-up (workloads_measure.host_speed; the first round's with
                --rounds): serving runs at the host's speed, which varies by process
  rounds        with --rounds: the number of rounds and the range of step ms (serving:
                of tokens/s) over them
"""
import argparse
import collections
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The model and workloads (workloads.py) and the measurement (workloads_measure.py) live
# beside this file, one concern each.
# Its directory is on sys.path when it runs as a script; also under -P / -I.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from workloads import churn, serving, tokens, training  # noqa: E402
from workloads_measure import GPUPOOL_ALLOCATORS, Probe, Recorder, log  # noqa: E402

WORKLOADS = ("training", "tokens", "serving", "churn")
ALLOCATORS = ("native", "expandable", "rmm", "split", "arena", "arena-nolend")
# GPUPOOL_ALLOCATORS (split, arena, arena-nolend): in workloads_measure.py.
QUICK = os.environ.get("BENCH_QUICK") == "1"
GIB = float(1 << 30)

# Sizes: full runs take 20-40 s on an H200 and peak at several GiB (training up to ~30 GiB
# at sequence length 2048); quick runs only check that everything works.
CONFIG = {
    "training": dict(vocab=32000, d=1024, layers=8, heads=16, batch=8, t_min=128, t_max=2048, t_step=64,
                     warmup=10, steps=40),
    # 96 requests arriving faster than 32 slots drain them: the server full most of the
    # time, KV caches growing token by token (~25 s per allocator on an H100).
    # Token-budget batching: every step draws a sequence length uniformly and sizes the batch
    # to about `tokens` tokens, so almost no step repeats a shape, and no warm-up step runs
    # the longest one (bf16 autocast, as mixed-precision training scripts do).
    "tokens": dict(vocab=32000, d=1024, layers=8, heads=16, tokens=16384, t_min=64, t_max=1023,
                   warmup=20, steps=40),
    "serving": dict(vocab=32000, d=1024, layers=4, heads=16, requests=96, max_active=32, prompt=(32, 384),
                    gen=(16, 160), mean_gap=1.5, warmup=30, steps=None),
    "churn": dict(slots=256, ops=1000, lo=512, hi=32 << 20, warmup=5, steps=30),
}
QUICK_CONFIG = {
    "training": dict(vocab=1024, d=128, layers=2, heads=4, batch=2, t_min=32, t_max=128, t_step=32,
                     warmup=2, steps=3),
    "tokens": dict(vocab=1024, d=128, layers=2, heads=4, tokens=256, t_min=16, t_max=64, warmup=2, steps=3),
    "serving": dict(vocab=1024, d=128, layers=2, heads=4, requests=12, max_active=4, prompt=(8, 32),
                    gen=(4, 16), mean_gap=1.0, warmup=5, steps=None),
    "churn": dict(slots=32, ops=200, lo=512, hi=1 << 20, warmup=1, steps=2),
}


# Environment variables that select an allocator. Only the chosen allocator's are kept: a
# caller's global PYTORCH_CUDA_ALLOC_CONF would otherwise turn `native` into something else.
SWITCHES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "GPUPOOL_POOL", "GPUPOOL_ARENA_LEND")


def switches(allocator):
    if allocator == "expandable":
        return {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    if allocator == "arena-nolend":  # the arena without loans between its two ranges
        return {"GPUPOOL_POOL": "arena", "GPUPOOL_ARENA_LEND": "0"}
    if allocator in GPUPOOL_ALLOCATORS:
        return {"GPUPOOL_POOL": allocator}
    return {}


# --------------------------------------------------------------------------- run mode

def run(workload, allocator):
    # Everything that selects an allocator must be in the environment before torch loads.
    for k in SWITCHES:
        os.environ.pop(k, None)
    os.environ.update(switches(allocator))
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    import torch

    random.seed(0)
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        # Deterministic mode would otherwise fill every fresh allocation (churn's buffers
        # completely instead of one byte): without this switch, go without the mode (the
        # ops used here are deterministic anyway).
        import torch.utils.deterministic
        torch.utils.deterministic.fill_uninitialized_memory = False
        torch.use_deterministic_algorithms(True, warn_only=True)
    except Exception as e:  # noqa: BLE001
        log(f"deterministic algorithms not enabled: {e!r}")

    probe = Probe(allocator, torch)
    torch.cuda.init()
    rec = Recorder(torch, probe, f"{workload}/{allocator}")  # baseline: context, no allocations
    probe.after_baseline()
    torch.ones(1, device="cuda").add_(1)  # first kernel, first allocation
    torch.cuda.synchronize()

    c = (QUICK_CONFIG if QUICK else CONFIG)[workload]
    steps = int(os.environ["BENCH_STEPS"]) if os.environ.get("BENCH_STEPS") else c["steps"]
    log(f"{rec.label}: {torch.cuda.get_device_name()} torch {torch.__version__} quick={QUICK} steps={steps}")
    t0 = time.perf_counter()
    fingerprint = {"training": training, "tokens": tokens, "serving": serving, "churn": churn}[workload](torch, rec, c, steps)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    rec.sample()

    c1 = probe.counters()
    n = len(rec.measured)
    per_step = lambda a, b: (b - a) / n if n and a is not None and b is not None else None  # noqa: E731
    peak_used = rec.peak_used - rec.baseline
    peak_alloc, peak_res, res_src = probe.peaks(peak_used)
    peak_req = probe.peak_requested()
    ms = [x * 1e3 for x in rec.measured]
    result = {
        "workload": workload, "allocator": allocator, "quick": QUICK,
        "steps_warmup": len(rec.warm), "steps_measured": n,
        "step_ms_median": statistics.median(ms) if ms else None,
        "step_ms_mean": statistics.fmean(ms) if ms else None,
        "step_ms_min": min(ms) if ms else None, "step_ms_max": max(ms) if ms else None,
        "step_ms_by_step": [round(x, 3) for x in ms],
        "tokens_measured": rec.tokens if workload == "serving" else None,
        "tokens_per_s": rec.tokens / sum(rec.measured) if workload == "serving" and rec.measured else None,
        "peak_allocated_bytes": peak_alloc, "peak_reserved_bytes": peak_res, "peak_reserved_source": res_src,
        "reserved_over_allocated": peak_res / peak_alloc if peak_alloc and peak_res is not None else None,
        "peak_requested_bytes": peak_req,
        "reserved_over_requested": peak_res / peak_req if peak_req and peak_res is not None else None,
        "peak_device_used_bytes": peak_used, "baseline_device_used_bytes": rec.baseline,
        "device_allocs_frees_per_step": per_step(rec.c0[0], c1[0]),
        "driver_calls_per_step": per_step(rec.c0[1], c1[1]),
        "steps_with_device_allocs_frees": rec.calling_steps[0] if c1[0] is not None else None,
        "steps_with_driver_calls": rec.calling_steps[1] if c1[1] is not None else None,
        "calls_by_step": rec.per_step,
        "calls_per_step_second_half": (statistics.fmean(rec.per_step[len(rec.per_step) // 2:])
                                       if rec.per_step else None),
        "new_peak_by_step": rec.new_peak,
        **off_peak(rec.per_step, rec.new_peak),
        "driver_calls": None, "gpupool_arena": None,
        "fingerprint": fingerprint,
        "fingerprint_sha256": hashlib.sha256(fingerprint.encode()).hexdigest()[:16],
        "wall_s": wall, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        **rec.host,
    }
    result.update(probe.extra())
    print(json.dumps(result), flush=True)
    sys.stderr.flush()
    # Skip interpreter teardown: tensors freed after an allocator's module is gone can crash
    # at exit, which would turn a finished measurement into a failure.
    if os.environ.get("GPUPOOL_TRACE"):
        sys.exit(0)  # let gpupool's at-exit handler finish the trace file
    os._exit(0)


# --------------------------------------------------------------------------- all mode

def run_one(workload, allocator):
    """One fresh process; returns (result dict or None, last stderr lines)."""
    env = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    env.update(switches(allocator))
    tail = collections.deque(maxlen=20)
    with tempfile.TemporaryFile("w+") as out:  # a file, not a pipe: stdout cannot block the child
        p = subprocess.Popen([sys.executable, __file__, "run", workload, allocator], env=env,
                             stdout=out, stderr=subprocess.PIPE, text=True)
        for line in p.stderr:  # progress, live
            log("  " + line.rstrip())
            tail.append(line.rstrip())
        rc = p.wait()
        out.seek(0)
        lines = [ln for ln in out.read().splitlines() if ln.startswith("{")]
    if not lines:
        tail.append(f"(exit status {rc}, no result line)")
        return None, list(tail)
    if rc != 0:
        log(f"{workload}/{allocator}: exit status {rc} after its result line; result kept")
    return json.loads(lines[-1]), list(tail)


def fmt(v, spec, scale=1.0):
    return "-" if v is None else format(v / scale, spec)


def calling(r):
    """Measured steps that made a driver call (gpupool) or a device allocation or free
    (the others), out of all measured steps."""
    n = r.get("steps_with_driver_calls")
    if n is None:
        n = r.get("steps_with_device_allocs_frees")
    return "-" if n is None else f"{n}/{r['steps_measured']}"


def merge_rounds(workload, runs):
    """One row from a (workload, allocator)'s rounds: the first round's figures, with the
    median over the rounds for the speed columns and their range in "rounds"."""
    runs = [r for r in runs if r]
    if not runs:
        return None
    if len(runs) == 1:
        return runs[0]
    key = "tokens_per_s" if workload == "serving" else "step_ms_median"
    vals = sorted(r[key] for r in runs if r.get(key) is not None)
    m = dict(runs[0])
    m["step_ms_median"] = statistics.median(r["step_ms_median"] for r in runs if r.get("step_ms_median") is not None)
    if workload == "serving":
        m["tokens_per_s"] = statistics.median(vals) if vals else None
    m["rounds"] = f"{len(runs)} ({fmt(vals[0], '.2f' if key == 'step_ms_median' else '.0f')}-"
    m["rounds"] += f"{fmt(vals[-1], '.2f' if key == 'step_ms_median' else '.0f')})" if vals else "-)"
    return m


def off_peak(per_step, new_peak):
    """The second half's steps that reached a new peak of bytes handed out, and the mean
    calls of the others (the steady state excepts growth to a new peak)."""
    half = len(per_step) // 2
    calls, peaks = per_step[half:], new_peak[half:]
    if not calls or len(peaks) != len(calls) or any(p is None for p in peaks):
        return {"second_half_new_peak_steps": None, "second_half_new_peak_calls": None,
                "calls_per_step_second_half_off_peak": None}
    rest = [c for c, p in zip(calls, peaks) if not p]
    return {"second_half_new_peak_steps": sum(peaks),
            "second_half_new_peak_calls": sum(c for c, p in zip(calls, peaks) if p),
            "calls_per_step_second_half_off_peak": statistics.fmean(rest) if rest else None}


def off_peak_cell(r):
    v = r.get("calls_per_step_second_half_off_peak")
    return "-" if v is None else f"{v:.2f} ({r['second_half_new_peak_steps']})"


def table(workload, allocators, results):
    native = results.get("native")
    base = native["step_ms_median"] if native else None
    head = ["allocator", "step ms", "vs native", "peak alloc GiB", "peak rsrvd GiB", "rsrvd/alloc", "rsrvd/requested",
            "peak dev used GiB", "allocs+frees/step", "driver/step", "2nd half/step", "2nd half off peak (new-peak steps)", "steps calling"] + (["tokens/s", "host launch us"] if workload == "serving" else [])
    with_rounds = any("rounds" in r for r in results.values() if r)
    head += ["rounds"] if with_rounds else []
    rows = []
    for a in allocators:
        r = results.get(a)
        if r is None:
            rows.append([a, "FAILED"] + [""] * (len(head) - 2))
            continue
        ms = r["step_ms_median"]
        rows.append([a, fmt(ms, ".2f"), f"{ms / base:.2f}x" if base and ms else "-",
                     fmt(r["peak_allocated_bytes"], ".3f", GIB), fmt(r["peak_reserved_bytes"], ".3f", GIB),
                     fmt(r["reserved_over_allocated"], ".3f"), fmt(r.get("reserved_over_requested"), ".3f"),
                     fmt(r["peak_device_used_bytes"], ".3f", GIB),
                     fmt(r["device_allocs_frees_per_step"], ".2f"), fmt(r["driver_calls_per_step"], ".2f"),
                     fmt(r.get("calls_per_step_second_half"), ".2f"), off_peak_cell(r), calling(r)]
                    + ([fmt(r["tokens_per_s"], ".0f"), fmt(r.get("host_launch_us"), ".2f")] if workload == "serving" else [])
                    + ([r.get("rounds", "1")] if with_rounds else []))
    widths = [max(len(str(x[i])) for x in [head] + rows) for i in range(len(head))]
    line = lambda cells: "| " + " | ".join(str(x).ljust(w) for x, w in zip(cells, widths)) + " |"  # noqa: E731
    print(f"\n### {workload}\n")
    print(line(head))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print(line(row))


def outputs_line(workload, allocators, results):
    groups = collections.defaultdict(list)
    for a, r in results.items():
        groups[r["fingerprint_sha256"]].append(a)
    ran = {k.split("#")[0] for k in results}  # "arena#2": the arena's second round
    failed = [a for a in allocators if a not in ran]
    note = f" ({', '.join(failed)} failed, not compared)" if failed else ""
    runs = f" ({len(results)} runs)" if len(results) > len(ran) else ""
    if not groups:
        return f"{workload}: no results to compare"
    if len(groups) == 1:
        return f"{workload}: outputs identical across {len(ran)} allocator(s){runs}{note}: {next(iter(groups))}"
    return f"{workload}: outputs DIFFER{note}: " + "; ".join(f"{','.join(v)} = {k}" for k, v in groups.items())


def main_all(args):
    workloads = [w for w in args.workloads.split(",") if w]
    allocators = [a for a in args.allocators.split(",") if a]
    bad = [w for w in workloads if w not in WORKLOADS] + [a for a in allocators if a not in ALLOCATORS]
    if bad:
        sys.exit(f"unknown workload or allocator: {', '.join(bad)} (workloads: {', '.join(WORKLOADS)}; "
                 f"allocators: {', '.join(ALLOCATORS)})")
    if args.rounds < 1:
        sys.exit("--rounds must be at least 1")
    collected = collections.defaultdict(list)  # (workload, allocator) -> one result (or None) a round
    for w in workloads:
        for n in range(args.rounds):
            for a in allocators:
                log(f"== {w} / {a}" + (f" (round {n + 1} of {args.rounds})" if args.rounds > 1 else ""))
                r, tail = run_one(w, a)
                if r is None:
                    log(f"{w}/{a}: FAILED; last stderr lines:\n    " + "\n    ".join(tail))
                else:
                    r["round"] = n + 1
                collected[(w, a)].append(r)
                if args.out:  # after every run, so a later crash keeps what was measured
                    with open(args.out, "w") as f:
                        for (w2, a2), rs in collected.items():
                            for r2 in rs:
                                f.write(json.dumps(r2 if r2 else {"workload": w2, "allocator": a2, "failed": True}) + "\n")
    merged = {(w, a): merge_rounds(w, collected[(w, a)]) for w in workloads for a in allocators}
    for w in workloads:
        table(w, allocators, {a: merged[(w, a)] for a in allocators if merged[(w, a)]})
    print()
    for w in workloads:
        # Every round's outputs are compared, not only the first's.
        every = {f"{a}#{i + 1}" if args.rounds > 1 else a: r
                 for a in allocators for i, r in enumerate(collected[(w, a)]) if r}
        print(outputs_line(w, allocators, every))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("run", help="one workload with one allocator, in this process")
    r.add_argument("workload", choices=WORKLOADS)
    r.add_argument("allocator", choices=ALLOCATORS)
    a = sub.add_parser("all", help="every (workload, allocator) in its own process, then the tables")
    a.add_argument("--workloads", default=",".join(WORKLOADS))
    a.add_argument("--allocators", default=",".join(ALLOCATORS))
    a.add_argument("--rounds", type=int, default=1)
    a.add_argument("--out")
    args = ap.parse_args()
    if args.mode == "run":
        run(args.workload, args.allocator)
    else:
        main_all(args)


if __name__ == "__main__":
    main()
