"""The build of gpupool's PyTorch allocator class (csrc/torch_allocator.cpp), and its install.

Why a build at run time: the class derives from PyTorch's C++ `CUDAAllocator`, whose layout
and C++ ABI are those of the installed PyTorch; libgpupool.so is built without PyTorch. So the
class is compiled here against the installed PyTorch's headers with
torch.utils.cpp_extension.load, once per source and PyTorch version, into PyTorch's
extension cache (later processes load it without compiling), and given the functions of the
libgpupool.so that Python loaded. `python -m gpupool build-torch` builds it ahead of time
(for images whose first process should not compile).

What it needs: a C++ compiler, ninja, PyTorch's headers (every PyTorch wheel has them) and the
CUDA runtime's headers, from a CUDA toolkit or from the `nvidia-cuda-runtime` and
`nvidia-cuda-crt` packages.
"""

import ctypes
import glob
import hashlib
import os
import pathlib
import shutil
import sys

from . import GpupoolError, _fn_address

ENV = "GPUPOOL_TORCH_ALLOCATOR"
_ACCEPTED = "0 | 1 (also true/false, yes/no, on/off)"  # as the library's own boolean variables

SOURCE = pathlib.Path(__file__).resolve().parent / "csrc" / "torch_allocator.cpp"

# The library's C headers (`include/` of the repository, shipped in the package): the class
# takes its declarations, stats struct and status codes from them, so a signature that
# changed in the library stops the class's build.
HEADERS = pathlib.Path(__file__).resolve().parent / "csrc" / "include"


def wanted(compiled):
    """(build the class?, must it succeed?) for install()'s `compiled` argument: None follows
    GPUPOOL_TORCH_ALLOCATOR (default on; a failed build then warns and falls back to the
    plug-in route), an explicit True or False wins (True: a failed build raises). A malformed
    value of the variable is an error either way, as for the library's own variables."""
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
    if compiled is None:
        return (True if env_on is None else env_on), False
    return bool(compiled), bool(compiled)


def _headers_text():
    return "".join(p.read_text() for p in sorted(HEADERS.glob("*.h")))


def _name(torch, source):
    """The extension's name, keyed by what the binary depends on: a change of the source, of
    the library's headers or of PyTorch builds a new one beside the old instead of loading a
    stale one."""
    h = hashlib.sha256()
    # Also the C++ ABI and the installation's place: one cache serves several environments
    # (a pip and a conda PyTorch of one version are different binaries).
    abi = str(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", ""))
    for part in (source, _headers_text(), torch.__version__, str(getattr(torch.version, "git_version", "")), abi,
                 os.path.dirname(os.path.realpath(torch.__file__))):
        h.update(part.encode())
        h.update(b"\0")
    return "gpupool_torch_allocator_" + h.hexdigest()[:16]


def _build_directory(torch, name):
    """The folder torch.utils.cpp_extension would choose for `name` (TORCH_EXTENSIONS_DIR, else
    its per-Python, per-CUDA folder under the user's cache), chosen here so that the library's
    path is known before the build, and without importing cpp_extension (which brings
    setuptools with it) where the library is built already."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        cu = "cpu" if torch.version.cuda is None else "cu" + torch.version.cuda.replace(".", "")
        py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        from torch import _appdirs
        cache = os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions"))
        root = os.path.join(cache, f"{py}_{cu}")
    return os.path.join(root, name)


# Members of PyTorch's CUDAAllocator interface that only some PyTorch versions declare: the
# class defines each where the installed headers declare it (-D<macro>), so one source
# builds against every supported version.
OPTIONAL_MEMBERS = {
    "attachOomRejectionObserver": "GPUPOOL_TORCH_OOM_REJECTION_OBSERVER",
}

READY = "built"  # the marker a finished build leaves beside the library


def _stamp(path):
    """What the marker records of a finished library: its size and modification time."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return f"{st.st_size} {st.st_mtime_ns}\n"


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _interface_flags(torch):
    header = os.path.join(os.path.dirname(torch.__file__), "include", "c10", "cuda", "CUDACachingAllocator.h")
    try:
        with open(header) as f:
            text = f.read()
    except OSError:
        return []
    return [f"-D{macro}" for member, macro in OPTIONAL_MEMBERS.items() if f" {member}(" in text]


def _cuda_runtime(cpp_extension):
    """(include folder, libcudart path) of the CUDA runtime: a toolkit's (CUDA_HOME, nvcc on
    PATH, /usr/local/cuda) or the nvidia-* wheels' PyTorch itself runs on."""
    homes = [cpp_extension.CUDA_HOME] if getattr(cpp_extension, "CUDA_HOME", None) else []
    roots = []
    for site in sys.path:
        roots += sorted(glob.glob(os.path.join(site, "nvidia", "cu*")), reverse=True)
        roots.append(os.path.join(site, "nvidia", "cuda_runtime"))
    for root in homes + roots:
        inc = os.path.join(root, "include")
        if not (os.path.isfile(os.path.join(inc, "cuda_runtime_api.h"))
                and os.path.isfile(os.path.join(inc, "crt", "host_config.h"))):
            continue
        for libdir in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib")):
            found = sorted(glob.glob(os.path.join(root, libdir, "libcudart.so*")), key=len)
            if found:
                return inc, found[0]
    raise RuntimeError("the CUDA runtime's headers were not found (no CUDA toolkit: set CUDA_HOME, or "
                       "pip install nvidia-cuda-runtime nvidia-cuda-crt of PyTorch's CUDA version)")


def _install(path):
    so = ctypes.CDLL(path)
    names = so.gpupool_torch_allocator_function_names
    names.restype = ctypes.c_char_p
    # The class says which library functions it takes, in its order.
    wanted = [n for n in names().decode().split(",") if n]
    install = so.gpupool_torch_allocator_install
    install.restype = ctypes.c_int
    install.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    try:
        fns = (ctypes.c_void_p * len(wanted))(*[_fn_address(n) for n in wanted])
    except AttributeError as e:
        raise OSError(f"{path} calls a library function the loaded libgpupool.so does not export ({e}): "
                      "the class and the library are of different versions") from e
    err = ctypes.create_string_buffer(4096)
    if install(fns, len(wanted), err, len(err)) != 0:
        raise RuntimeError(err.value.decode(errors="replace"))
    return path


def _short(e):
    """The gist of a build error (a failed compile carries the whole compiler output)."""
    lines = [l.strip() for l in str(e).splitlines() if l.strip()]
    text = " / ".join(lines[-4:]) if lines else type(e).__name__
    return text if len(text) <= 600 else "..." + text[-600:]


def build():
    """Path of the class's library, built first where needed (with a one-line notice on
    stderr). Raises RuntimeError saying why it cannot be built."""
    import torch
    source = SOURCE.read_text()
    name = _name(torch, source)
    d = _build_directory(torch, name)
    so = os.path.join(d, name + ".so")
    ready = os.path.join(d, READY)
    # Built before: use it without a compiler or ninja (deployments often have neither).
    # The marker is written (atomically) only after a build finished and names the
    # library's size and time, so a library it matches is complete, whatever the build's
    # own locking leaves in the folder (a rebuild in progress rewrites the library first).
    if _stamp(so) is not None and _read(ready) == _stamp(so):
        return so
    try:
        from torch.utils import cpp_extension
    except Exception as e:  # cpp_extension needs setuptools, for one
        raise RuntimeError(f"torch.utils.cpp_extension cannot be imported ({_short(e)})") from e
    compiler = os.environ.get("CXX", "c++")  # what cpp_extension runs on Linux
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler: {compiler!r} is not on PATH (set CXX to one)")
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja, which torch.utils.cpp_extension builds with, is not installed (pip install ninja)")
    include, cudart = _cuda_runtime(cpp_extension)
    try:
        os.makedirs(d, exist_ok=True)
        src = os.path.join(d, "torch_allocator.cpp")
        old = None
        if os.path.isfile(src):
            with open(src) as f:
                old = f.read()
        if old != source:  # rewriting an unchanged source would make ninja rebuild it
            with open(src, "w") as f:
                f.write(source)
        print(f"gpupool: compiling its PyTorch allocator once (about a minute; cached in {d})", file=sys.stderr,
              flush=True)
        torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
        # Several processes may get here at once: cpp_extension.load serializes the build
        # (its lock), and each writes the same marker after it.
        cpp_extension.load(name=name, sources=[src], extra_cflags=["-O2", *_interface_flags(torch)],
                           extra_include_paths=[include, str(HEADERS)],
                           extra_ldflags=[f"-L{torch_lib}", "-ltorch_cuda", "-lc10_cuda", cudart],
                           build_directory=d, is_python_module=False, with_cuda=False, verbose=False)
        tmp = f"{ready}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(_stamp(so))
        os.replace(tmp, ready)
        return so
    except Exception as e:
        raise RuntimeError(f"building {name} in {d} failed: {_short(e)}") from e


def install():
    """Build (where needed) and install the class as PyTorch's CUDA allocator. Raises
    RuntimeError saying why where it cannot be."""
    return _install(build())
