"""Numba external memory manager: `NUMBA_CUDA_MEMORY_MANAGER=gpupool.numba`, or
`numba.cuda.set_memory_manager(gpupool.numba.GpupoolMemoryManager)` before Numba's CUDA
context is created.

Device memory comes from gpupool's pool of the context's device, so Numba shares one pool
with PyTorch, CuPy and C code. Numba passes no stream to allocators: blocks are allocated
and freed on the legacy default stream (RMM's Numba plug-in does the same), and Numba
frees them when their arrays are collected (deferred by Numba's own `defer_cleanup`).
Pinned and mapped host memory stay Numba's own (`HostOnlyCUDAMemoryManager`); IPC
handles use Numba's `GetIpcHandleMixin` (memory from the `device` upstream's
`cuMemAlloc` segments can be shared; the arena's VMM memory cannot, as with CUDA IPC).
"""

import ctypes

try:
    from numba import cuda as _cuda
    from numba.cuda import GetIpcHandleMixin, HostOnlyCUDAMemoryManager, MemoryInfo, MemoryPointer
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("gpupool.numba needs Numba's CUDA target (pip install numba-cuda): " + str(e)) from e

from . import _check, lib, reclaim, stats


def _device_ptr(value):
    """The pointer type this Numba's driver binding wants.

    Older Numba chose between its own ctypes binding and NVIDIA's `cuda-python` with
    `USE_NV_BINDING`; numba-cuda 0.2x has only NVIDIA's binding and dropped the flag (a
    ctypes pointer there fails in `int(ptr)`), as RMM's plug-in assumes too.
    """
    try:
        from numba.cuda.cudadrv import driver as _driver
        use_nv_binding = getattr(_driver, "USE_NV_BINDING", True)
    except ImportError:  # pragma: no cover - depends on the environment
        use_nv_binding = True
    if use_nv_binding:
        try:
            from cuda.bindings.driver import CUdeviceptr
        except ImportError:
            from cuda.cuda import CUdeviceptr
        return CUdeviceptr(value)
    return ctypes.c_uint64(value)


class GpupoolMemoryManager(GetIpcHandleMixin, HostOnlyCUDAMemoryManager):
    """Numba's device allocations through gpupool."""

    def initialize(self):
        lib()  # load the library (and with it the pool) before the first allocation

    def _device(self):
        return self.context.device.id

    def memalloc(self, size):
        dev = self._device()
        p = ctypes.c_void_p()
        L = lib()
        _check(L.gpupool_malloc(ctypes.byref(p), size, dev, None))
        addr = p.value or 0

        def finalizer(addr=addr, dev=dev, L=L):
            L.gpupool_free(addr, dev, None)

        return MemoryPointer(self.context, _device_ptr(addr), size, finalizer=finalizer)

    def get_memory_info(self):
        s = stats(self._device())
        return MemoryInfo(free=s["device_free_bytes"], total=s["device_total_bytes"])

    def reset(self):
        super().reset()
        reclaim(self._device())

    @property
    def interface_version(self):
        return 1


# The name Numba looks for in the module named by NUMBA_CUDA_MEMORY_MANAGER.
_numba_memory_manager = GpupoolMemoryManager
del _cuda
