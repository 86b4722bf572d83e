"""CuPy integration: gpupool as CuPy's device allocator (CFunctionAllocator), its pinned
host allocator, and CUDA graph capture with the pool installed.

Streams: CuPy passes no stream to allocators, so `install()` gives the library CuPy's own
`get_current_stream_ptr` (a C function CuPy exports in `cupy.cuda.stream.__pyx_capi__`):
every allocation is made for CuPy's current stream and every free goes to the stream the
block was allocated for, with cross-stream reuse guarded by events as for PyTorch. Any
stream kind works: `Stream()`, `Stream(non_blocking=True)`, `Stream.ptds`,
`ExternalStream`, from any thread.
"""

import contextlib
import ctypes
import itertools
import weakref

from . import _check, _fn_address, lib


def _current_stream_getter():
    """Address of cupy.cuda.stream's `intptr_t get_current_stream_ptr(void)`."""
    import cupy.cuda.stream as cs
    capsule = cs.__pyx_capi__["get_current_stream_ptr"]
    api = ctypes.pythonapi
    api.PyCapsule_GetName.restype, api.PyCapsule_GetName.argtypes = ctypes.c_char_p, [ctypes.py_object]
    api.PyCapsule_GetPointer.restype, api.PyCapsule_GetPointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    name = api.PyCapsule_GetName(capsule)
    sig = name.decode().replace(" ", "")
    if sig not in ("intptr_t(void)", "intptr_t(void)noexcept"):
        raise RuntimeError(f"gpupool: CuPy's get_current_stream_ptr has signature {name!r}, not 'intptr_t (void)'")
    return api.PyCapsule_GetPointer(capsule, name)


def allocator():
    import cupy
    L = lib()
    try:
        L.gpupool_cupy_set_stream_getter(_current_stream_getter())
    except (AttributeError, KeyError, RuntimeError, TypeError) as e:
        # A CuPy without the exported getter: the older stream-less rule (blocks reused after
        # a fence on the legacy stream, which orders blocking streams only).
        import warnings
        warnings.warn(f"gpupool: CuPy's current stream is not reachable ({e}); allocations follow the legacy "
                      "stream: synchronise non-blocking streams before dropping their arrays", RuntimeWarning)
        L.gpupool_cupy_set_stream_getter(None)
    return cupy.cuda.memory.CFunctionAllocator(0, _fn_address("gpupool_cupy_malloc"), _fn_address("gpupool_cupy_free"), L)


class _Pinned:
    """One pinned block; freed through gpupool when CuPy drops its last pointer to it."""

    def __init__(self, size):
        p = ctypes.c_void_p()
        _check(lib().gpupool_pinned_malloc(ctypes.byref(p), size, None))
        self.ptr, self.size = p.value or 0, size

    def __int__(self):
        return self.ptr

    def __del__(self):
        if self.ptr:
            lib().gpupool_pinned_free(self.ptr, None)
            self.ptr = 0


def pinned_malloc(size):
    """For cupy.cuda.set_pinned_memory_allocator: page-locked host memory from gpupool's
    pinned pool."""
    import cupy
    return cupy.cuda.PinnedMemoryPointer(_Pinned(size), 0)


def install(pinned=True):
    """Make gpupool CuPy's device allocator (every device), and its pinned host allocator
    (`pinned=True`). Out of memory raises an exception carrying gpupool's message (see
    README: CuPy wraps it in SystemError)."""
    import cupy
    alloc = allocator()
    cupy.cuda.set_allocator(alloc.malloc)
    if pinned:
        cupy.cuda.set_pinned_memory_allocator(pinned_malloc)
    return alloc


_pool_ids = itertools.count(1)


class CapturedGraph:
    """A CUDA graph captured by `capture()`. The memory its capture allocated stays in a
    private pool of gpupool until this object and the graph are gone."""

    def __init__(self, device, pool_id):
        self.graph = None
        self._device, self._pool_id = device, pool_id

    def launch(self, stream=None):
        self.graph.launch(stream)


def _release(device, pool_id):
    try:
        lib().gpupool_release_pool(device, pool_id)
    except Exception:  # interpreter shutdown: the pool goes with the process
        pass


@contextlib.contextmanager
def capture(stream=None):
    """Capture a CUDA graph on `stream` (default: a new non-blocking stream) with the
    allocations made during the capture kept for the graph:

        with gpupool.cupy.capture() as g:
            y = x * 2
        g.launch()
    """
    import cupy
    dev = cupy.cuda.Device().id
    if stream is None:
        stream = cupy.cuda.Stream(non_blocking=True)
    pool_id = next(_pool_ids)
    g = CapturedGraph(dev, pool_id)
    L = lib()
    with stream:
        stream.begin_capture()
        try:
            _check(L.gpupool_begin_allocate_to_pool(dev, pool_id, stream.ptr))
        except BaseException:
            stream.end_capture()
            raise
        try:
            yield g
        finally:
            try:
                g.graph = stream.end_capture()
            finally:
                _check(L.gpupool_end_allocate_to_pool(dev, pool_id))
    try:
        weakref.finalize(g.graph, _release, dev, pool_id)   # the graph itself, where it allows
    except TypeError:
        weakref.finalize(g, _release, dev, pool_id)
