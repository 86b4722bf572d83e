"""Memory efficiency and speed of CUDA allocators on realistic PyTorch workloads.

usage:
    python3 scripts/bench_workloads.py run WORKLOAD ALLOCATOR
        one workload with one allocator in this process; prints one JSON line on stdout
        (progress goes to stderr).
    python3 scripts/bench_workloads.py all [--workloads training,serving,churn]
                                           [--allocators native,expandable,rmm,split,arena]
                                           [--out FILE.jsonl]
        one fresh process per (workload, allocator) (an allocator must be chosen before
        PyTorch touches the GPU); prints a markdown table per workload, then whether all
        allocators produced identical outputs.

Workloads: training (transformer, random sequence length per step, AdamW), tokens (the
same model with token-budget batching: a new sequence length and batch size every step,
bf16 autocast, no warm-up at the longest shape), serving
(incremental decoding, per-request KV caches grown with torch.cat), churn (256 live
buffers, random free + log-uniform random allocation).
Allocators: native (PyTorch default), expandable (expandable_segments:True), rmm (RMM pool
through rmm_torch_allocator), split / arena (gpupool with GPUPOOL_POOL=split / arena;
GPUPOOL_LIBRARY names the library).

Environment: BENCH_STEPS overrides the number of measured steps (serving: measured decoding
iterations, the run stops there); BENCH_QUICK=1 makes every workload tiny (smoke run);
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
  rsrvd/alloc   peak rsrvd / peak alloc (1.00 = no waste)
  peak dev used device memory in use by the process (total - free from cudaMemGetInfo),
                sampled after every step and inside steps (training: after the forward
                pass; churn: every 250 ops), minus the same figure right after CUDA
                context creation: the cross-check valid for every allocator
  allocs+frees  device memory allocations + releases per measured step (native/expandable:
                memory_stats num_device_alloc + num_device_free; gpupool: upstream
                allocs + frees; rmm: cudaMalloc/cudaFree under the pool)
  driver/step   gpupool only: driver calls per measured step (stats_json driver_calls.total)
  2nd half/step the same, mean over the second half of the measured steps (the steady state)
  steps calling measured steps that made a driver call (gpupool) or a device allocation or
                free (the others): growth at a new peak, apart from a steady state
  tokens/s      serving only: tokens generated in measured iterations / their time
"""
import argparse
import collections
import contextlib
import hashlib
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKLOADS = ("training", "tokens", "serving", "churn")
ALLOCATORS = ("native", "expandable", "rmm", "split", "arena", "arena-nolend")
GPUPOOL_ALLOCATORS = ("split", "arena", "arena-nolend")
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


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- allocators

def _get(obj, key):
    """RMM's allocation_counts was a dict and became a Statistics object: read either."""
    return obj[key] if isinstance(obj, dict) else getattr(obj, key)


class Probe:
    """Installs one allocator and reads its counters. Installation happens in two parts
    because the baseline device usage must be read between them: after the CUDA context
    exists, but before the allocator reserves anything (RMM reserves its whole initial pool
    when created, which a baseline taken after a first tensor would hide)."""

    def __init__(self, name, torch):
        self.name, self.torch = name, torch
        self.gp = self.rmm_up = self.rmm_top = None
        if name in GPUPOOL_ALLOCATORS:
            sys.path.insert(0, str(REPO / "python"))
            import gpupool
            self.gp = gpupool
            gpupool.torch.install()
        elif name == "rmm":
            from rmm.allocators.torch import rmm_torch_allocator
            # The allocator looks RMM's current resource up on every call, so the pool can
            # be set after the switch (and after the baseline), as long as nothing is
            # allocated in between.
            torch.cuda.memory.change_current_allocator(rmm_torch_allocator)

    def after_baseline(self):
        if self.name != "rmm":
            return
        import rmm
        init = os.environ.get("BENCH_RMM_INITIAL_POOL") or None
        if init and init.isdigit():
            init = int(init)
        try:
            # pool_allocator=True of rmm.reinitialize, with statistics adaptors above the
            # pool (bytes handed to tensors) and below it (bytes taken from cudaMalloc).
            up = rmm.mr.StatisticsResourceAdaptor(rmm.mr.CudaMemoryResource())
            top = rmm.mr.StatisticsResourceAdaptor(rmm.mr.PoolMemoryResource(up, initial_pool_size=init))
            rmm.mr.set_current_device_resource(top)
            _get(top.allocation_counts, "peak_bytes")
            self.rmm_up, self.rmm_top = up, top
        except Exception as e:  # noqa: BLE001 - any API drift: fall back to the plain pool
            log(f"rmm: statistics adaptors unavailable ({e!r}); plain pool, peaks from device samples")
            rmm.reinitialize(pool_allocator=True, initial_pool_size=init)

    def counters(self):
        """(device allocs+frees, gpupool driver calls) so far; None where unknown."""
        if self.gp is not None:
            s = self.gp.stats(0)
            dc = self.gp.stats_json(0).get("driver_calls")
            total = dc.get("total") if isinstance(dc, dict) else None
            return s["n_upstream_allocs"] + s["n_upstream_frees"], total
        if self.name == "rmm":
            if self.rmm_up is None:
                return None, None
            c = self.rmm_up.allocation_counts
            # total_count counts allocations; those no longer current were freed.
            return 2 * _get(c, "total_count") - _get(c, "current_count"), None
        m = self.torch.cuda.memory_stats()
        if "num_device_alloc" not in m:
            return None, None
        return m["num_device_alloc"] + m.get("num_device_free", 0), None

    def peaks(self, peak_device_used):
        """(peak allocated, peak reserved, where the reserved figure comes from)."""
        if self.gp is not None:
            s = self.gp.stats(0)
            return s["peak_used_bytes"], s["peak_total_bytes"], "gpupool stats"
        if self.name == "rmm":
            if self.rmm_top is None:
                return None, peak_device_used, "device samples"
            return (_get(self.rmm_top.allocation_counts, "peak_bytes"),
                    _get(self.rmm_up.allocation_counts, "peak_bytes"), "rmm adaptor under the pool")
        return self.torch.cuda.max_memory_allocated(), self.torch.cuda.max_memory_reserved(), "torch"

    def extra(self):
        if self.gp is None:
            return {}
        sj = self.gp.stats_json(0)
        return {"driver_calls": sj.get("driver_calls"), "gpupool_arena": sj.get("arena"), "gpupool_stats": sj}


class Recorder:
    """Step timing, device memory samples and the counters at the end of warm-up."""

    def __init__(self, torch, probe, label):
        self.torch, self.probe, self.label = torch, probe, label
        free, total = torch.cuda.mem_get_info()
        self.baseline = total - free
        self.peak_used = self.baseline
        self.warm, self.measured = [], []
        self.measuring = False
        self.tokens = 0
        self.c0 = (None, None)
        # Per measured step: whether it made a device allocation or free (every allocator)
        # and a driver call (gpupool), so growth at a new peak reads apart from a steady
        # state that calls nothing.
        self.calling_steps = [0, 0]
        # Driver calls (gpupool) or device allocations + frees (the others) of each measured step.
        self.per_step = []

    def sample(self):
        free, total = self.torch.cuda.mem_get_info()
        self.peak_used = max(self.peak_used, total - free)

    def mark_warm(self):
        self.measuring = True
        self.c0 = self.probe.counters()

    @contextlib.contextmanager
    def step(self):
        self.torch.cuda.synchronize()
        before = self.probe.counters() if self.measuring else None
        t0 = time.perf_counter()
        yield
        self.torch.cuda.synchronize()
        (self.measured if self.measuring else self.warm).append(time.perf_counter() - t0)
        if before is not None:
            after = self.probe.counters()
            for i in range(2):
                if before[i] is not None and after[i] is not None and after[i] > before[i]:
                    self.calling_steps[i] += 1
            k = 1 if before[1] is not None else 0
            if before[k] is not None and after[k] is not None:
                self.per_step.append(after[k] - before[k])
        self.sample()

    def progress(self, i, total=None, extra="", every=None):
        every = every or max(1, (total or 10) // 10)
        if i % every == 0 or i + 1 == total:
            last = (self.measured or self.warm)[-1] * 1e3
            log(f"{self.label}: step {i + 1}{f'/{total}' if total else ''} {last:.1f} ms {extra}")


# --------------------------------------------------------------------------- model

def build_model(torch, vocab, d, layers, heads):
    nn, F = torch.nn, torch.nn.functional
    hd = d // heads

    def attend(q, k, v, mask):
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        if mask is not None:
            att = att.masked_fill(mask, float("-inf"))
        return att.softmax(-1) @ v

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.ln2, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def heads(self, x):  # [B, T, d] -> q, k, v as [B, H, T, hd]
            B, T, _ = x.shape
            return self.qkv(self.ln1(x)).view(B, T, 3, heads, hd).permute(2, 0, 3, 1, 4)

        def finish(self, x, y):  # attention output y [B, H, T, hd] -> next residual stream
            B, T, _ = x.shape
            x = x + self.proj(y.transpose(1, 2).reshape(B, T, d))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

        def forward(self, x):  # causal self-attention over the whole sequence
            q, k, v = self.heads(x)
            T = x.shape[1]
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
            return self.finish(x, attend(q, k, v, mask)), k, v

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

        def forward(self, tokens):  # [B, T] -> logits [B, T, vocab]
            x = self.emb(tokens)
            for b in self.blocks:
                x = b(x)[0]
            return self.head(self.ln_f(x))

        def prefill(self, prompt):  # [T] -> last logits [vocab], per-layer (k, v) [H, T, hd]
            x, caches = self.emb(prompt)[None], []
            for b in self.blocks:
                x, k, v = b(x)
                caches.append((k[0].contiguous(), v[0].contiguous()))
            return self.head(self.ln_f(x[0, -1])), caches

        def decode(self, tok, caches):  # tok [1] -> logits [vocab]; caches grow by one token
            x = self.emb(tok)[None]
            for i, b in enumerate(self.blocks):
                q, k, v = b.heads(x)
                kc, vc = caches[i]
                # The naive growth: a fresh, one-token-longer allocation per token and layer.
                kc, vc = torch.cat([kc, k[0]], dim=1), torch.cat([vc, v[0]], dim=1)
                caches[i] = (kc, vc)
                x = b.finish(x, attend(q[0], kc, vc, None)[None])
            return self.head(self.ln_f(x[0, -1]))

    torch.manual_seed(0)
    return Model().cuda()  # initialised on the CPU: identical weights whatever the GPU state


# --------------------------------------------------------------------------- workloads

def training(torch, rec, c, steps):
    F = torch.nn.functional
    model = build_model(torch, c["vocab"], c["d"], c["layers"], c["heads"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    rng, gen = random.Random(42), torch.Generator().manual_seed(42)
    losses, total = [], c["warmup"] + steps
    for i in range(total):
        if i == c["warmup"]:
            rec.mark_warm()
        # The first step runs the longest sequence, as training scripts do to fail fast on
        # memory: the peak shape is then part of the warm-up, and the measured steps show
        # what an allocator does once it has seen it.
        T = c["t_max"] if i == 0 else rng.randrange(c["t_min"], c["t_max"] + 1, c["t_step"])
        batch = torch.randint(c["vocab"], (c["batch"], T + 1), generator=gen).cuda()
        with rec.step():
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, c["vocab"]), batch[:, 1:].reshape(-1))
            del logits
            rec.sample()  # activations are at their peak here
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(f"{loss.item():.6g}")
        rec.progress(i, total, f"T={T} loss={losses[-1]}")
    return " ".join(losses)


def tokens(torch, rec, c, steps):
    F = torch.nn.functional
    model = build_model(torch, c["vocab"], c["d"], c["layers"], c["heads"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    rng, gen = random.Random(4242), torch.Generator().manual_seed(4242)
    losses, total = [], c["warmup"] + steps
    for i in range(total):
        if i == c["warmup"]:
            rec.mark_warm()
        T = rng.randint(c["t_min"], c["t_max"])
        B = max(1, c["tokens"] // T)
        batch = torch.randint(c["vocab"], (B, T + 1), generator=gen).cuda()
        with rec.step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(batch[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, c["vocab"]).float(), batch[:, 1:].reshape(-1))
            del logits
            rec.sample()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(f"{loss.item():.6g}")
        rec.progress(i, total, f"T={T} B={B} loss={losses[-1]}")
    return " ".join(losses)


def serving(torch, rec, c, steps):
    model = build_model(torch, c["vocab"], c["d"], c["layers"], c["heads"]).eval()
    rng, gen = random.Random(7), torch.Generator().manual_seed(7)
    arrivals, t = collections.deque(), 0.0
    for _ in range(c["requests"]):  # arrival time (in iterations), prompt length, tokens to generate
        t += rng.expovariate(1.0 / c["mean_gap"])
        arrivals.append((t, rng.randint(*c["prompt"]), rng.randint(*c["gen"])))
    limit = None if steps is None else c["warmup"] + steps
    active, done_tokens, clock, it = [], 0, 0.0, 0
    with torch.inference_mode():  # everything, so done_sum stays an inference tensor throughout
        done_sum = torch.zeros((), dtype=torch.long, device="cuda")
        while (arrivals or active) and (limit is None or it < limit):
            if not active and arrivals[0][0] > clock:
                clock = arrivals[0][0]  # idle server: jump to the next arrival
            if it == c["warmup"]:
                rec.mark_warm()
            with rec.step():
                produced, fresh = 0, []
                while arrivals and arrivals[0][0] <= clock and len(active) + len(fresh) < c["max_active"]:
                    _, plen, ngen = arrivals.popleft()
                    prompt = torch.randint(c["vocab"], (plen,), generator=gen).cuda()
                    logits, caches = model.prefill(prompt)
                    tok = logits.argmax(-1, keepdim=True)
                    fresh.append({"caches": caches, "tok": tok, "out": [tok], "n": ngen})
                    produced += 1
                for r in active:  # one decode step per request, one request at a time
                    r["tok"] = model.decode(r["tok"], r["caches"]).argmax(-1, keepdim=True)
                    r["out"].append(r["tok"])
                    produced += 1
                active += fresh
                still = []
                for r in active:
                    if len(r["out"]) >= r["n"]:  # finished: its caches are freed here
                        done_sum += torch.cat(r["out"]).sum()
                        done_tokens += len(r["out"])
                    else:
                        still.append(r)
                active = still
            if rec.measuring:
                rec.tokens += produced
            rec.progress(it, limit, f"active={len(active)} queued={len(arrivals)}", every=100)
            clock += 1
            it += 1
        for r in active:  # cut short by BENCH_STEPS: count what the unfinished requests produced
            done_sum += torch.cat(r["out"]).sum()
            done_tokens += len(r["out"])
        return f"tokens={done_tokens} sum={int(done_sum.item())}"


def churn(torch, rec, c, steps):
    rng, lo, hi = random.Random(1234), math.log(c["lo"]), math.log(c["hi"])
    allocated = 0

    def alloc():
        nonlocal allocated
        n = int(math.exp(rng.uniform(lo, hi)))
        allocated += n
        t = torch.empty(n, dtype=torch.uint8, device="cuda")
        t[0] = 1  # touch it: a real kernel writes into the block
        return t

    slots = [alloc() for _ in range(c["slots"])]
    total = c["warmup"] + steps
    for s in range(total):
        if s == c["warmup"]:
            rec.mark_warm()
        with rec.step():
            for op in range(c["ops"]):
                i = rng.randrange(c["slots"])
                slots[i] = None  # free first, as a program dropping its last reference does
                slots[i] = alloc()
                if op % 250 == 249:
                    rec.sample()
        rec.progress(s, total)
    return f"allocated_bytes={allocated}"


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
    ms = [x * 1e3 for x in rec.measured]
    result = {
        "workload": workload, "allocator": allocator, "quick": QUICK,
        "steps_warmup": len(rec.warm), "steps_measured": n,
        "step_ms_median": statistics.median(ms) if ms else None,
        "step_ms_mean": statistics.fmean(ms) if ms else None,
        "step_ms_min": min(ms) if ms else None, "step_ms_max": max(ms) if ms else None,
        "tokens_measured": rec.tokens if workload == "serving" else None,
        "tokens_per_s": rec.tokens / sum(rec.measured) if workload == "serving" and rec.measured else None,
        "peak_allocated_bytes": peak_alloc, "peak_reserved_bytes": peak_res, "peak_reserved_source": res_src,
        "reserved_over_allocated": peak_res / peak_alloc if peak_alloc and peak_res is not None else None,
        "peak_device_used_bytes": peak_used, "baseline_device_used_bytes": rec.baseline,
        "device_allocs_frees_per_step": per_step(rec.c0[0], c1[0]),
        "driver_calls_per_step": per_step(rec.c0[1], c1[1]),
        "steps_with_device_allocs_frees": rec.calling_steps[0] if c1[0] is not None else None,
        "steps_with_driver_calls": rec.calling_steps[1] if c1[1] is not None else None,
        "calls_by_step": rec.per_step,
        "calls_per_step_second_half": (statistics.fmean(rec.per_step[len(rec.per_step) // 2:])
                                       if rec.per_step else None),
        "driver_calls": None, "gpupool_arena": None,
        "fingerprint": fingerprint,
        "fingerprint_sha256": hashlib.sha256(fingerprint.encode()).hexdigest()[:16],
        "wall_s": wall, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
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


def table(workload, allocators, results):
    native = results.get("native")
    base = native["step_ms_median"] if native else None
    head = ["allocator", "step ms", "vs native", "peak alloc GiB", "peak rsrvd GiB", "rsrvd/alloc",
            "peak dev used GiB", "allocs+frees/step", "driver/step", "2nd half/step", "steps calling"] + (["tokens/s"] if workload == "serving" else [])
    rows = []
    for a in allocators:
        r = results.get(a)
        if r is None:
            rows.append([a, "FAILED"] + [""] * (len(head) - 2))
            continue
        ms = r["step_ms_median"]
        rows.append([a, fmt(ms, ".2f"), f"{ms / base:.2f}x" if base and ms else "-",
                     fmt(r["peak_allocated_bytes"], ".3f", GIB), fmt(r["peak_reserved_bytes"], ".3f", GIB),
                     fmt(r["reserved_over_allocated"], ".3f"), fmt(r["peak_device_used_bytes"], ".3f", GIB),
                     fmt(r["device_allocs_frees_per_step"], ".2f"), fmt(r["driver_calls_per_step"], ".2f"),
                     fmt(r.get("calls_per_step_second_half"), ".2f"), calling(r)]
                    + ([fmt(r["tokens_per_s"], ".0f")] if workload == "serving" else []))
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
    failed = [a for a in allocators if a not in results]
    note = f" ({', '.join(failed)} failed, not compared)" if failed else ""
    if not groups:
        return f"{workload}: no results to compare"
    if len(groups) == 1:
        return f"{workload}: outputs identical across {len(results)} allocator(s){note}: {next(iter(groups))}"
    return f"{workload}: outputs DIFFER{note}: " + "; ".join(f"{','.join(v)} = {k}" for k, v in groups.items())


def main_all(args):
    workloads = [w for w in args.workloads.split(",") if w]
    allocators = [a for a in args.allocators.split(",") if a]
    bad = [w for w in workloads if w not in WORKLOADS] + [a for a in allocators if a not in ALLOCATORS]
    if bad:
        sys.exit(f"unknown workload or allocator: {', '.join(bad)} (workloads: {', '.join(WORKLOADS)}; "
                 f"allocators: {', '.join(ALLOCATORS)})")
    collected = {}
    for w in workloads:
        for a in allocators:
            log(f"== {w} / {a}")
            r, tail = run_one(w, a)
            if r is None:
                log(f"{w}/{a}: FAILED; last stderr lines:\n    " + "\n    ".join(tail))
            collected[(w, a)] = r
            if args.out:  # after every run, so a later crash keeps what was measured
                with open(args.out, "w") as f:
                    for (w2, a2), r2 in collected.items():
                        f.write(json.dumps(r2 if r2 else {"workload": w2, "allocator": a2, "failed": True}) + "\n")
    for w in workloads:
        table(w, allocators, {a: collected[(w, a)] for a in allocators if collected[(w, a)]})
    print()
    for w in workloads:
        print(outputs_line(w, allocators, {a: collected[(w, a)] for a in allocators if collected[(w, a)]}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("run", help="one workload with one allocator, in this process")
    r.add_argument("workload", choices=WORKLOADS)
    r.add_argument("allocator", choices=ALLOCATORS)
    a = sub.add_parser("all", help="every (workload, allocator) in its own process, then the tables")
    a.add_argument("--workloads", default=",".join(WORKLOADS))
    a.add_argument("--allocators", default=",".join(ALLOCATORS))
    a.add_argument("--out")
    args = ap.parse_args()
    if args.mode == "run":
        run(args.workload, args.allocator)
    else:
        main_all(args)


if __name__ == "__main__":
    main()
