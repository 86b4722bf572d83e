"""Measurement side of bench/workloads/bench_workloads.py: installing one allocator and reading its
counters (Probe), and timing steps and sampling device memory (Recorder).

Separate from bench_workloads.py (command line, configuration, run and all modes) and from
workloads.py (the model and the workloads): how it is measured, apart from what. Imported
by bench_workloads.py, whose directory is on sys.path. Does not import torch (it is handed
in), so --help works without it.
"""
import contextlib
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GPUPOOL_ALLOCATORS = ("split", "arena", "arena-nolend")


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

    def peak_allocated(self):
        """The peak of bytes handed out so far (None where the allocator does not say)."""
        if self.gp is not None:
            return self.gp.stats(0)["peak_used_bytes"]
        if self.name == "rmm":
            return None if self.rmm_top is None else _get(self.rmm_top.allocation_counts, "peak_bytes")
        return self.torch.cuda.max_memory_allocated()

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

    def peak_requested(self):
        """The peak of bytes the program asked for, whatever each allocator rounds them up to
        or hands out beyond them (PyTorch's own counts blocks it did not split whole):
        PyTorch's `requested_bytes`, the statistics adaptor above RMM's pool, gpupool's
        `peak_requested_bytes` (a library before it: its peak in use, which rounds requests
        and, for `split`, counts blocks it did not split whole). None where unknown."""
        if self.gp is not None:
            s = self.gp.stats(0)
            return s.get("peak_requested_bytes", s["peak_used_bytes"])
        if self.name == "rmm":
            return None if self.rmm_top is None else _get(self.rmm_top.allocation_counts, "peak_bytes")
        return self.torch.cuda.memory_stats().get("requested_bytes.all.peak")

    def extra(self):
        if self.gp is None:
            return {}
        sj = self.gp.stats_json(0)
        return {"driver_calls": sj.get("driver_calls"), "gpupool_arena": sj.get("arena"), "gpupool_stats": sj}


def host_speed(torch):
    """How fast this process's host runs, measured once between warm-up and the measured
    steps: a pure-Python loop (ms) and the mean time of 20,000 kernel launches (us).
    Why: a workload that launches many small kernels (serving) runs at the host's speed,
    which varies by process on one machine by more than the allocators differ
    (docs/benchmarks.md, "Serving runs at the host's speed"); these say which processes
    ran on a slow host.
    A failure is recorded, not raised: it must not cost the measurement."""
    try:
        t0 = time.perf_counter()
        x = 0
        for i in range(1_000_000):
            x += i
        loop_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20_000):
            torch.cuda._sleep(0)  # a kernel that allocates nothing: the allocators' sequence is untouched
        torch.cuda.synchronize()
        launch_us = (time.perf_counter() - t0) / 20_000 * 1e6
    except Exception as e:  # noqa: BLE001
        return {"host_probe_error": repr(e)}
    return {"host_py_loop_ms": loop_ms, "host_launch_us": launch_us}


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
        # Per measured step: whether the bytes handed out reached a new peak during it (issue
        # the steady state's driver calls except such steps: growth to hold more is
        # no waste); None where the allocator does not report its peak.
        self.new_peak = []
        self.host = {}

    def sample(self):
        free, total = self.torch.cuda.mem_get_info()
        self.peak_used = max(self.peak_used, total - free)

    def mark_warm(self):
        self.host = host_speed(self.torch)
        self.measuring = True
        self.c0 = self.probe.counters()

    @contextlib.contextmanager
    def step(self):
        self.torch.cuda.synchronize()
        before = self.probe.counters() if self.measuring else None
        peak_before = self.probe.peak_allocated() if self.measuring else None
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
                peak_after = self.probe.peak_allocated()
                self.new_peak.append(None if peak_before is None or peak_after is None else peak_after > peak_before)
        self.sample()

    def progress(self, i, total=None, extra="", every=None):
        every = every or max(1, (total or 10) // 10)
        if i % every == 0 or i + 1 == total:
            last = (self.measured or self.warm)[-1] * 1e3
            log(f"{self.label}: step {i + 1}{f'/{total}' if total else ''} {last:.1f} ms {extra}")
