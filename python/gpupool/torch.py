"""PyTorch integration: gpupool as PyTorch's CUDA allocator, with every hook installed.

CUDA graphs: `torch.cuda.graph`, `torch.cuda.make_graphed_callables` and `MemPool`
scopes reach gpupool through the begin/end-allocate-to-pool and release-pool hooks, which
keep each graph's memory in a private pool (see README, "CUDA graphs").

`torch.compile(mode="reduce-overhead")` uses inductor's CUDA-graph *trees* by default,
which call `torch._C._cuda_checkPoolLiveAllocations`; PyTorch's `CUDAPluggableAllocator`
does not forward that method (c10/cuda/CUDACachingAllocator.h declares it with a default
that raises "... does not yet support checkPoolLiveAllocations", and
torch/csrc/cuda/CUDAPluggableAllocator.h does not override it). So `install()` switches
inductor to its plain CUDA graphs (`torch._inductor.config.triton.cudagraph_trees =
False`), which capture through `torch.cuda.graph`, the route gpupool supports.
"""

from . import _fn_address, library_path, lib

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


def allocator():
    """A CUDAPluggableAllocator over gpupool with all hooks set."""
    import torch
    lib()  # load with RTLD_GLOBAL first: the same library (and pool) PyTorch will open
    alloc = torch.cuda.memory.CUDAPluggableAllocator(library_path(), "gpupool_torch_malloc", "gpupool_torch_free")
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


def install(compile_graphs=True):
    """Make gpupool PyTorch's CUDA allocator (call before PyTorch allocates on the GPU).
    `compile_graphs`: also route torch.compile's CUDA graphs through torch.cuda.graph
    (see the module notes). Afterwards torch.cuda.memory_stats() raises (PyTorch's
    limitation for plug-ins): use gpupool.stats() and gpupool.memory_status()."""
    import torch
    alloc = allocator()
    torch.cuda.memory.change_current_allocator(alloc)
    if compile_graphs:
        use_plain_cuda_graphs_in_compile()
    return alloc


def mempool():
    """A torch.cuda.MemPool whose segments come from gpupool; PyTorch caches inside it.
    Use with `with torch.cuda.use_mem_pool(pool): ...`."""
    import torch
    return torch.cuda.MemPool(allocator()._allocator)
