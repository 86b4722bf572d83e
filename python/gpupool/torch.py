"""PyTorch integration: gpupool as PyTorch's CUDA allocator, with every hook installed.

CUDA graphs: `torch.cuda.graph`, `torch.cuda.make_graphed_callables` and `MemPool`
scopes reach gpupool through the begin/end-allocate-to-pool and release-pool hooks, which
keep each graph's memory in a private pool (see docs/graphs.md).

`torch.compile(mode="reduce-overhead")` uses inductor's CUDA-graph *trees* by default,
which call `torch._C._cuda_checkPoolLiveAllocations`; PyTorch's `CUDAPluggableAllocator`
does not forward that method (c10/cuda/CUDACachingAllocator.h declares it with a default
that raises "... does not yet support checkPoolLiveAllocations", and
torch/csrc/cuda/CUDAPluggableAllocator.h does not override it). So `install()` switches
inductor to its plain CUDA graphs (`torch._inductor.config.triton.cudagraph_trees =
False`), which capture through `torch.cuda.graph`, the route gpupool supports.

Out of memory: PyTorch maps a C++ exception from the allocation function to a Python
exception by its C++ type, and only `c10::OutOfMemoryError` becomes `torch.OutOfMemoryError`
(= `torch.cuda.OutOfMemoryError`, a `RuntimeError` subclass). libgpupool.so, built without
PyTorch, can only throw standard exceptions (a plain `RuntimeError` in Python). So by default
(`typed_oom=None`, GPUPOOL_TORCH_TYPED_OOM unset or 1) the allocation function PyTorch calls
is a small C++ shim compiled once against the installed PyTorch (gpupool/_torch_oom.py: a
few seconds, cached in PyTorch's extension cache, rebuilt only when its source or PyTorch
changes; later processes load it without compiling). It calls gpupool_malloc and throws
`c10::OutOfMemoryError` when gpupool reports GPUPOOL_STATUS_OUT_OF_MEMORY (device memory or
the pool limit), `c10::Error` (RuntimeError) otherwise, with gpupool's message. The free
goes through the shim to gpupool_torch_free unchanged (PyTorch takes both functions from one
library); every other hook stays gpupool's own function. Where the shim cannot be built (no C++
compiler, no ninja, no headers), one warning says why and the library's own function is
installed: out of memory is then a plain RuntimeError with the same message.
GPUPOOL_TORCH_TYPED_OOM=0 (or `typed_oom=False`) chooses that path without compiling.
"""

import warnings

from . import _fn_address, _torch_oom, library_path, lib

# (setter names across PyTorch versions, gpupool function)
_HOOKS = [
    (("set_init_fn",), "gpupool_torch_init"),
    (("set_reset_fn",), "gpupool_torch_reset"),                     # torch.cuda.empty_cache()
    (("set_memory_fraction_fn",), "gpupool_torch_memory_fraction"),  # set_per_process_memory_fraction
    (("set_record_stream_fn",), "gpupool_torch_record_stream"),     # Tensor.record_stream
    (("set_base_alloc_fn",), "gpupool_torch_base_alloc"),
    (("set_begin_allocate_to_pool", "set_begin_allocate_to_pool_fn"), "gpupool_torch_begin_allocate_to_pool"),
    (("set_end_allocate_to_pool_fn", "set_end_allocate_to_pool"), "gpupool_torch_end_allocate_to_pool"),
    (("set_release_pool", "set_release_pool_fn"), "gpupool_torch_release_pool"),
]


_SHIM = None      # the shim's path once built and loaded in this process
_SHIM_ERROR = None  # why it could not be, once tried


def _typed_oom_shim(typed_oom):
    """The shim's path, or None for the library's own allocation function (see the module
    notes). A failed build is tried once per process and warned about once."""
    global _SHIM, _SHIM_ERROR
    on, required = _torch_oom.wanted(typed_oom)
    if not on:
        return None
    if _SHIM is None and _SHIM_ERROR is None:
        try:
            _SHIM = _torch_oom.build()
        except Exception as e:
            _SHIM_ERROR = str(e)
            if not required:
                warnings.warn(f"gpupool: PyTorch will report gpupool's out of memory as a plain RuntimeError, not "
                              f"torch.OutOfMemoryError: the shim that raises it could not be built ({_SHIM_ERROR}). "
                              f"Install a C++ compiler and ninja, or set {_torch_oom.ENV}=0 to choose the plain "
                              "RuntimeError without this warning.", RuntimeWarning, stacklevel=3)
    if _SHIM is None and required:
        raise RuntimeError(f"gpupool: typed_oom=True, but the shim that raises torch.OutOfMemoryError could not be "
                           f"built: {_SHIM_ERROR}")
    return _SHIM


def allocator(typed_oom=None):
    """A CUDAPluggableAllocator over gpupool with all hooks set. `typed_oom`: out of memory
    raises torch.OutOfMemoryError through the compiled shim (None: as GPUPOOL_TORCH_TYPED_OOM
    says, default on, falling back with a warning; True: the shim or an error; False: the
    library's function, a plain RuntimeError). `.typed_oom` on the result says which."""
    import torch
    lib()  # load with RTLD_GLOBAL first: the same library (and pool) PyTorch will open
    shim = _typed_oom_shim(typed_oom)
    if shim is not None:
        alloc = torch.cuda.memory.CUDAPluggableAllocator(shim, "gpupool_torch_oom_malloc", "gpupool_torch_oom_free")
    else:
        alloc = torch.cuda.memory.CUDAPluggableAllocator(library_path(), "gpupool_torch_malloc", "gpupool_torch_free")
    alloc.typed_oom = shim is not None
    inner = alloc._allocator
    for setters, fn in _HOOKS:
        setter = next((getattr(inner, s) for s in setters if hasattr(inner, s)), None)
        if setter is None:
            raise RuntimeError(f"gpupool: this PyTorch ({torch.__version__}) has none of {setters} on "
                               "CUDAPluggableAllocator; gpupool needs PyTorch 2.3 or newer")
        setter(_fn_address(fn))
    return alloc


def use_plain_cuda_graphs_in_compile():
    """Make torch.compile(mode="reduce-overhead") capture with torch.cuda.graph instead of
    CUDA-graph trees (which need an allocator method plug-ins cannot provide)."""
    try:
        import torch._inductor.config as inductor_config
    except Exception:  # inductor unavailable: nothing to configure
        return False
    inductor_config.triton.cudagraph_trees = False
    return True


def install(compile_graphs=True, typed_oom=None):
    """Make gpupool PyTorch's CUDA allocator (call before PyTorch allocates on the GPU).
    `compile_graphs`: also route torch.compile's CUDA graphs through torch.cuda.graph
    (see the module notes). `typed_oom`: see allocator(); by default out of memory raises
    torch.OutOfMemoryError with gpupool's report. Afterwards torch.cuda.memory_stats()
    raises (PyTorch's limitation for plug-ins): use gpupool.stats() and
    gpupool.memory_status()."""
    import torch
    alloc = allocator(typed_oom)
    torch.cuda.memory.change_current_allocator(alloc)
    if compile_graphs:
        use_plain_cuda_graphs_in_compile()
    return alloc


def mempool(typed_oom=None):
    """A torch.cuda.MemPool whose segments come from gpupool; PyTorch caches inside it.
    Use with `with torch.cuda.use_mem_pool(pool): ...`. `typed_oom`: see allocator()."""
    import torch
    return torch.cuda.MemPool(allocator(typed_oom)._allocator)
