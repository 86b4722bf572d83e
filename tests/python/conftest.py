"""Helpers for the Python tests. Every GPU scenario runs in a fresh subprocess: PyTorch's
allocator can only be swapped before CUDA is initialised, once per process."""
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


# GPUPOOL_TEST_INSTALLED=1: test the installed package (`pip install .`), not the source
# tree: no PYTHONPATH to python/, no GPUPOOL_LIBRARY; the interpreter running pytest is used.
INSTALLED = os.environ.get("GPUPOOL_TEST_INSTALLED") == "1"


def _lib():
    env = os.environ.get("GPUPOOL_LIBRARY")
    if env:
        return env
    for p in (ROOT / "target" / "release" / "libgpupool.so", ROOT / "dist" / "libgpupool.so"):
        if p.is_file():
            return str(p)
    return str(ROOT / "target" / "release" / "libgpupool.so")


def _env(env):
    e = dict(os.environ)
    if INSTALLED:
        e.pop("GPUPOOL_LIBRARY", None)
    else:
        e["PYTHONPATH"] = str(ROOT / "python") + os.pathsep + e.get("PYTHONPATH", "")
        e["GPUPOOL_LIBRARY"] = _lib()
    e["PYTHONUNBUFFERED"] = "1"
    e.update(env or {})
    return e


# The start of a scenario under gpupool's compiled PyTorch allocator class.
TORCH_ALLOCATOR = """
import gpupool, torch
gpupool.torch.install(compiled=True)
assert gpupool.torch.route() == "allocator", gpupool.torch.route()
"""


def run_py(code, env=None, timeout=300):
    """Run `code` in a fresh interpreter with gpupool importable; returns CompletedProcess."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=_env(env), capture_output=True, text=True,
                          timeout=timeout)


def run_script(path, args, env=None, timeout=300):
    """Run the script `path` (a file: multiprocessing's spawn re-imports it in children)."""
    return subprocess.run([sys.executable, str(path), *args], env=_env(env), capture_output=True, text=True,
                          timeout=timeout)


# CuPy stream stresses: a kernel that spins, then fills a buffer (so a block handed to another
# stream too early is overwritten while its first user still checks it).
CUPY_SPIN_FILL = """
    spin = cupy.RawKernel(r'''
    extern "C" __global__ void spin_fill(unsigned *p, size_t n, unsigned v, long long cycles) {
        if (blockIdx.x == 0 && threadIdx.x == 0) { long long t = clock64(); while (clock64() - t < cycles) {} }
        __syncthreads();
        for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] = v;
    }''', "spin_fill")
"""


# The rule batch-size finders apply to an exception to decide "too big: retry smaller"
# (HF accelerate's `should_reduce_batch_size`, toma's; Lightning's scaler matches the same
# text), as code for the scenarios run in subprocesses.
_SHOULD_REDUCE_BATCH_SIZE = """
def should_reduce_batch_size(e):
    statements = ["CUDA out of memory.", "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
                  "DefaultCPUAllocator: can't allocate memory"]
    return isinstance(e, RuntimeError) and len(e.args) == 1 and any(s in e.args[0] for s in statements)
"""


def with_batch_rule(code):
    """`code` (indented as run_py takes it) with `should_reduce_batch_size` defined first."""
    return _SHOULD_REDUCE_BATCH_SIZE + textwrap.dedent(code)


def ok(p):
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p.stdout


def _probe(code):
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return p.returncode == 0, (p.stderr.strip().splitlines() or ["?"])[-1]


_cache = {}


def need(what):
    """Skip unless `what` ('torch', 'cupy') is importable and sees a GPU."""
    if what not in _cache:
        code = {"torch": "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 3)",
                "cupy": "import cupy,sys; sys.exit(0 if cupy.cuda.runtime.getDeviceCount() > 0 else 3)"}[what]
        _cache[what] = _probe(code)
    good, why = _cache[what]
    if not good:
        pytest.skip(f"{what} with a GPU is not available here ({why})")


@pytest.fixture
def torch_importable():
    """Skip unless torch imports (a GPU is not needed)."""
    if "torch-cpu" not in _cache:
        _cache["torch-cpu"] = _probe("import torch")
    good, why = _cache["torch-cpu"]
    if not good:
        pytest.skip(f"torch is not importable here ({why})")


@pytest.fixture
def torch_gpu():
    need("torch")


@pytest.fixture
def cupy_gpu():
    need("cupy")


@pytest.fixture
def library():
    if INSTALLED:
        return None  # the package finds its bundled library
    lib = _lib()
    if not pathlib.Path(lib).is_file():
        pytest.skip(f"libgpupool.so not built ({lib})")
    return lib
