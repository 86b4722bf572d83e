"""CuPy integration: gpupool as CuPy's allocator through CFunctionAllocator.

Stream policy: CuPy passes no stream to allocators. gpupool fences the legacy default
stream at every CuPy free, which makes reuse safe for CuPy's default stream, the per-thread
default stream and blocking streams (cupy.cuda.Stream(), CuPy's default). Streams created
with non_blocking=True are not ordered by that fence: synchronise them before dropping
arrays they use.
"""

from . import _fn_address, lib


def allocator():
    import cupy
    L = lib()
    return cupy.cuda.memory.CFunctionAllocator(0, _fn_address("gpupool_cupy_malloc"), _fn_address("gpupool_cupy_free"), L)


def install():
    """Make gpupool CuPy's device allocator (every device). Out of memory raises an
    exception carrying gpupool's message (see README: CuPy wraps it in SystemError)."""
    import cupy
    alloc = allocator()
    cupy.cuda.set_allocator(alloc.malloc)
    return alloc
