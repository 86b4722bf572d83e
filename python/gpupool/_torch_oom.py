"""The small C++ library through which gpupool's PyTorch allocator raises
`torch.OutOfMemoryError`, and its one-time build (used by gpupool.torch).

Why a build at run time: PyTorch turns a C++ exception that reaches its Python bindings into
a Python exception by the exception's C++ type, and only `c10::OutOfMemoryError` becomes
`torch.OutOfMemoryError` (torch/csrc/Exceptions.h); every other `std::exception` becomes a
plain `RuntimeError`. That class is declared in c10/util/Exception.h and its constructor
lives in libc10, whose C++ ABI is the one of the installed PyTorch: libgpupool.so is built
without PyTorch and cannot throw it. So the allocation entry point is compiled here against
the installed PyTorch's headers, with torch.utils.cpp_extension.load, once per source and
PyTorch version, into PyTorch's extension cache.

The source is kept in this module (not in a .cpp file) so that it ships with the package
without package-data rules.
"""

import ctypes
import hashlib
import os
import shutil
import sys

from . import GpupoolError, _fn_address

ENV = "GPUPOOL_TORCH_TYPED_OOM"
_ACCEPTED = "0 | 1 (also true/false, yes/no, on/off)"  # as the library's own boolean variables

# Bumped with any change of the exported functions' contract; the build checks it.
SHIM_VERSION = 1

SOURCE = r"""
// gpupool's allocation entry point for PyTorch's CUDAPluggableAllocator, compiled against the
// installed PyTorch by gpupool/_torch_oom.py (which says why). Free is forwarded unchanged.
#include <c10/util/Exception.h>

#include <atomic>
#include <cstddef>
#include <string>

namespace {

using MallocFn = int (*)(void **, size_t, int, void *);
using LastErrorFn = size_t (*)(char *, size_t);
using FreeFn = void (*)(void *, size_t, int, void *);

// Set once by gpupool_torch_oom_init before PyTorch is given the allocator: the functions of
// the libgpupool.so that Python loaded, so this shim can never reach another copy of it.
std::atomic<MallocFn> g_malloc{nullptr};
std::atomic<LastErrorFn> g_last_error{nullptr};
std::atomic<FreeFn> g_free{nullptr};

constexpr int kOutOfMemory = 5;  // GPUPOOL_STATUS_OUT_OF_MEMORY: device memory or pool limit

std::string last_error(int status) {
  LastErrorFn f = g_last_error.load(std::memory_order_acquire);
  std::string s;
  if (f != nullptr) {
    size_t n = f(nullptr, 0);
    s.assign(n + 1, '\0');
    f(&s[0], s.size());
    s.resize(n);
  }
  if (s.empty()) s = "gpupool: allocation failed with status " + std::to_string(status);
  // Out of memory carries PyTorch's phrase first (the library's text does): batch-size
  // finders (accelerate, Lightning) look for it to retry smaller.
  const char *phrase = "CUDA out of memory.";
  if (status == kOutOfMemory && s.find(phrase) == std::string::npos) s = std::string(phrase) + " " + s;
  return s;
}

}  // namespace

#define GPUPOOL_SHIM_EXPORT extern "C" __attribute__((visibility("default")))

GPUPOOL_SHIM_EXPORT int gpupool_torch_oom_init(void *malloc_fn, void *last_error_fn, void *free_fn) noexcept {
  g_malloc.store(reinterpret_cast<MallocFn>(malloc_fn), std::memory_order_release);
  g_last_error.store(reinterpret_cast<LastErrorFn>(last_error_fn), std::memory_order_release);
  g_free.store(reinterpret_cast<FreeFn>(free_fn), std::memory_order_release);
  return GPUPOOL_SHIM_VERSION;
}

// `void *alloc(size_t, int, cudaStream_t)`. PyTorch stores whatever comes back, so a failure
// must throw: c10::OutOfMemoryError (torch.OutOfMemoryError in Python) when gpupool ran out of
// memory or hit its limit, c10::Error (RuntimeError) for anything else, with gpupool's message.
GPUPOOL_SHIM_EXPORT void *gpupool_torch_oom_malloc(size_t size, int device, void *stream) {
  MallocFn m = g_malloc.load(std::memory_order_acquire);
  TORCH_CHECK(m != nullptr, "gpupool: the PyTorch allocation shim was called before gpupool_torch_oom_init");
  void *p = nullptr;
  int status = m(&p, size, device, stream);
  if (status == 0) return p;
  std::string msg = last_error(status);
  TORCH_CHECK_WITH(OutOfMemoryError, status != kOutOfMemory, msg);
  TORCH_CHECK(false, msg);
  return nullptr;  // not reached: both checks above throw
}

// `void free(void *, size_t, int, cudaStream_t)`: PyTorch takes both functions from one
// library, so the free comes through here to gpupool_torch_free.
GPUPOOL_SHIM_EXPORT void gpupool_torch_oom_free(void *ptr, size_t size, int device, void *stream) noexcept {
  FreeFn f = g_free.load(std::memory_order_acquire);
  if (f != nullptr) f(ptr, size, device, stream);
}
"""


def wanted(typed_oom):
    """(build the shim?, must it succeed?) for install()'s `typed_oom` argument: None follows
    GPUPOOL_TORCH_TYPED_OOM (default on; a failed build then warns and falls back), an
    explicit True or False wins (True: a failed build raises). A malformed value of the
    variable is an error either way, as for the library's own variables."""
    raw = os.environ.get(ENV)
    env_on = None
    if raw is not None:
        v = raw.strip().lower()
        if v in ("", "0", "false", "no", "off"):
            env_on = False
        elif v in ("1", "true", "yes", "on"):
            env_on = True
        else:
            raise GpupoolError(6, f'gpupool: invalid value "{raw}" for {ENV}; accepted: {_ACCEPTED}')
    if typed_oom is None:
        return (True if env_on is None else env_on), False
    return bool(typed_oom), bool(typed_oom)


def _name(torch):
    """The extension's name, keyed by what the binary depends on: a change of the source or of
    PyTorch builds a new one beside the old instead of loading a stale one. (Not the compiler:
    any compiler cpp_extension accepts gives a compatible binary.)"""
    h = hashlib.sha256()
    for part in (SOURCE, str(SHIM_VERSION), torch.__version__, str(getattr(torch.version, "git_version", ""))):
        h.update(part.encode())
        h.update(b"\0")
    return "gpupool_torch_oom_" + h.hexdigest()[:16]


def _build_directory(torch, cpp_extension, name):
    """The folder torch.utils.cpp_extension would choose for `name` (TORCH_EXTENSIONS_DIR, else
    its per-Python, per-CUDA folder under the cache root), chosen here so that the library's
    path is known before the build."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        cu = "cpu" if torch.version.cuda is None else "cu" + torch.version.cuda.replace(".", "")
        py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(cpp_extension.get_default_build_root(), f"{py}_{cu}")
    return os.path.join(root, name)


def _init(path):
    so = ctypes.CDLL(path)
    init = so.gpupool_torch_oom_init
    init.restype, init.argtypes = ctypes.c_int, [ctypes.c_void_p] * 3
    got = init(_fn_address("gpupool_malloc"), _fn_address("gpupool_last_error"), _fn_address("gpupool_torch_free"))
    if got != SHIM_VERSION:
        raise OSError(f"{path} is shim version {got}, expected {SHIM_VERSION}")
    return path


def _short(e):
    """The gist of a build error (a failed compile carries the whole compiler output)."""
    lines = [l.strip() for l in str(e).splitlines() if l.strip()]
    text = " / ".join(lines[-4:]) if lines else type(e).__name__
    return text if len(text) <= 600 else "..." + text[-600:]


def build():
    """Path of the shim library, loaded and initialised; built first where needed (with a
    one-line notice on stderr). Raises RuntimeError saying why it cannot be built."""
    try:
        import torch
        from torch.utils import cpp_extension
    except Exception as e:  # cpp_extension needs setuptools, for one
        raise RuntimeError(f"torch.utils.cpp_extension cannot be imported ({_short(e)})") from e
    name = _name(torch)
    d = _build_directory(torch, cpp_extension, name)
    so = os.path.join(d, name + ".so")
    # Built before: load it without a compiler or ninja (deployments often have neither).
    # The library is written only while the build holds the folder's lock file, so without
    # that file it is complete.
    if os.path.isfile(so) and not os.path.exists(os.path.join(d, "lock")):
        try:
            return _init(so)
        except (OSError, AttributeError):
            pass  # unloadable (say, a build cut short): build it again
    compiler = os.environ.get("CXX", "c++")  # what cpp_extension runs on Linux
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler: {compiler!r} is not on PATH (set CXX to one)")
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja, which torch.utils.cpp_extension builds with, is not installed (pip install ninja)")
    try:
        os.makedirs(d, exist_ok=True)
        src = os.path.join(d, "gpupool_torch_oom.cpp")
        text = f"#define GPUPOOL_SHIM_VERSION {SHIM_VERSION}\n" + SOURCE
        old = None
        if os.path.isfile(src):
            with open(src) as f:
                old = f.read()
        if old != text:  # rewriting an unchanged source would make ninja rebuild it
            with open(src, "w") as f:
                f.write(text)
        if not os.path.isfile(so):
            print(f"gpupool: compiling the PyTorch out-of-memory shim once (a few seconds; cached in {d})",
                  file=sys.stderr, flush=True)
        cpp_extension.load(name=name, sources=[src], extra_cflags=["-O2"], build_directory=d,
                           is_python_module=False, verbose=False)
        return _init(so)
    except Exception as e:
        raise RuntimeError(f"building {name} in {d} failed: {_short(e)}") from e
