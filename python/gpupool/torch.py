"""PyTorch integration: gpupool as PyTorch's CUDA allocator, with every hook installed."""

from . import _fn_address, library_path, lib

_HOOKS = [
    ("set_init_fn", "gpupool_torch_init"),
    ("set_reset_fn", "gpupool_torch_reset"),                     # torch.cuda.empty_cache()
    ("set_memory_fraction_fn", "gpupool_torch_memory_fraction"),  # set_per_process_memory_fraction
    ("set_record_stream_fn", "gpupool_torch_record_stream"),     # Tensor.record_stream
    ("set_base_alloc_fn", "gpupool_torch_base_alloc"),
]


def allocator():
    """A CUDAPluggableAllocator over gpupool with all hooks set."""
    import torch
    lib()  # load with RTLD_GLOBAL first: the same library (and pool) PyTorch will open
    alloc = torch.cuda.memory.CUDAPluggableAllocator(library_path(), "gpupool_torch_malloc", "gpupool_torch_free")
    inner = alloc._allocator
    for setter, fn in _HOOKS:
        getattr(inner, setter)(_fn_address(fn))
    return alloc


def install():
    """Make gpupool PyTorch's CUDA allocator (call before PyTorch allocates on the GPU).
    Afterwards torch.cuda.memory_stats() raises (PyTorch's limitation for plug-ins):
    use gpupool.stats() and gpupool.memory_status()."""
    import torch
    alloc = allocator()
    torch.cuda.memory.change_current_allocator(alloc)
    return alloc


def mempool():
    """A torch.cuda.MemPool whose segments come from gpupool; PyTorch caches inside it.
    Use with `with torch.cuda.use_mem_pool(pool): ...`."""
    import torch
    return torch.cuda.MemPool(allocator()._allocator)
