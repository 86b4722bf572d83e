"""CuPy integration: gpupool as CuPy's device allocator (CFunctionAllocator), its pinned
host allocator, and CUDA graph capture with the pool installed.

Streams: CuPy passes no stream to allocators, so `install()` gives the library CuPy's own
`get_current_stream_ptr` (a C function CuPy exports in `cupy.cuda.stream.__pyx_capi__`):
every allocation is made for CuPy's current stream and every free goes to the stream the
block was allocated for, with cross-stream reuse guarded by events as for PyTorch. Any
stream kind works: `Stream()`, `Stream(non_blocking=True)`, `Stream.ptds`,
`ExternalStream`, from any thread.

Out of memory raises `gpupool.cupy.OutOfMemoryError`, a subclass of
`cupy.cuda.memory.OutOfMemoryError` (hence of `MemoryError`) whose text is gpupool's report;
other failures raise `RuntimeError`. The library raises it through the Python C-API from the
C allocator CuPy calls (src/ffi/cupy.rs: a C++ exception would abort CuPy). Whether it reaches
the caller as is depends on whether CuPy checks for a Python error after calling a
`CFunctionAllocator`'s malloc:
- Where it does not (the cupy-cuda13x 14.2.0 wheel, seen on 2026-11-23; cupy/cupy's source
  declares the check from its v14.1.0 tag on, yet that wheel behaves without it), CPython
  reports `SystemError(... returned a result with an exception set)` with ours as its
  `__cause__`. The default (`install()`) keeps this fast C path all the same.
  `install(typed_oom=True)` installs `python_allocator()` instead: a
  `cupy.cuda.memory.PythonFunctionAllocator` calling the same C function through ctypes
  with the GIL held, so ours is raised as is, for one Python call per allocation.
- Where it does, ours reaches the caller from the C path: `except
  cupy.cuda.memory.OutOfMemoryError` catches it, and `typed_oom=True` keeps the C path.
Which case applies is found out by one call that fails before touching any pool (device -1,
`c_allocator_raises_typed()`), not from the version number.
"""

import contextlib
import ctypes
import itertools
import weakref

from . import _check, _fn_address, _framework, lib
from . import share as _share


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


_OOM_TYPE = None


def _oom_type():
    """gpupool.cupy.OutOfMemoryError, made on first use (it subclasses CuPy's class, and this
    module must import without CuPy)."""
    global _OOM_TYPE
    if _OOM_TYPE is None:
        from cupy.cuda.memory import OutOfMemoryError as CupyOutOfMemoryError

        class OutOfMemoryError(CupyOutOfMemoryError):
            """gpupool ran out of memory (or hit its limit) serving CuPy; the text is gpupool's
            report. CuPy's constructor takes (size, total, limit) and writes its own text; the
            library raises this class with the message alone (PyErr_SetString), so the
            constructor takes the message and keeps CuPy's attributes at "unknown"."""

            def __init__(self, message="CUDA out of memory. gpupool: out of memory", size=0, total=-1, limit=0):
                MemoryError.__init__(self, message)
                self._size, self._total, self._limit = size, total, limit

            def __reduce__(self):
                return (type(self), (str(self), self._size, self._total, self._limit))

        OutOfMemoryError.__module__ = __name__
        OutOfMemoryError.__qualname__ = "OutOfMemoryError"
        _OOM_TYPE = OutOfMemoryError
    return _OOM_TYPE


def __getattr__(name):
    # `except gpupool.cupy.OutOfMemoryError` and pickling work before install() too.
    if name == "OutOfMemoryError":
        return _oom_type()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _register(L):
    """Hand the library CuPy's current-stream getter and the class to raise for out of memory."""
    try:
        L.gpupool_cupy_set_stream_getter(_current_stream_getter())
    except (AttributeError, KeyError, RuntimeError, TypeError) as e:
        # A CuPy without the exported getter: the older stream-less rule (blocks reused after
        # a fence on the legacy stream, which orders blocking streams only).
        import warnings
        warnings.warn(f"gpupool: CuPy's current stream is not reachable ({e}); allocations follow the legacy "
                      "stream: synchronise non-blocking streams before dropping their arrays", RuntimeWarning)
        L.gpupool_cupy_set_stream_getter(None)
    setter = getattr(L, "gpupool_cupy_set_oom_error", None)
    if setter is not None:  # an older library (GPUPOOL_LIBRARY) raises MemoryError instead
        cls = _oom_type()
        # The library keeps a borrowed pointer for the life of the process: one reference
        # that is never released keeps the class alive even if this module is torn down.
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(cls))
        setter.restype, setter.argtypes = None, [ctypes.c_void_p]
        setter(id(cls))


def allocator():
    """A cupy.cuda.memory.CFunctionAllocator over gpupool's C functions (the fast path)."""
    import cupy
    L = lib()
    _register(L)
    return cupy.cuda.memory.CFunctionAllocator(0, _fn_address("gpupool_cupy_malloc"), _fn_address("gpupool_cupy_free"), L)


def python_allocator():
    """A cupy.cuda.memory.PythonFunctionAllocator over the same C functions, for a CuPy whose
    CFunctionAllocator does not pass a Python error on (see the module notes). ctypes
    calls them with the GIL held (PYFUNCTYPE) as CuPy's C path does: the library reads CuPy's
    current stream and raises through the C-API, and ctypes raises what the call set."""
    import cupy
    L = lib()
    _register(L)
    call_malloc = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)(
        _fn_address("gpupool_cupy_malloc"))
    call_free = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)(_fn_address("gpupool_cupy_free"))

    def malloc(size, device):
        p = call_malloc(None, size, device)
        if not p:  # only when the library found no interpreter to raise in (it then wrote to stderr)
            raise RuntimeError(f"gpupool: allocation of {size} bytes on device {device} failed")
        return p

    def free(ptr, device):
        call_free(None, ptr, device)

    return cupy.cuda.memory.PythonFunctionAllocator(malloc, free)


_C_PATH_RAISES = None


def c_allocator_raises_typed():
    """True when this CuPy passes a Python error raised by a CFunctionAllocator's malloc on
    to the caller, so the fast path raises gpupool.cupy.OutOfMemoryError as is (False for
    the cupy-cuda13x 14.2.0 wheel). Found out once by a call that fails without touching any
    pool (device -1)."""
    global _C_PATH_RAISES
    if _C_PATH_RAISES is None:
        import cupy.cuda.memory as cm
        allocator()  # the getter the library reads during the call
        try:
            cm.CFunctionAllocatorMemory(1, 0, _fn_address("gpupool_cupy_malloc"), _fn_address("gpupool_cupy_free"), -1)
            _C_PATH_RAISES = False  # no error at all: nothing to rely on
        except SystemError:
            _C_PATH_RAISES = False  # unchecked: ours arrives as the SystemError's cause
        except RuntimeError as e:
            _C_PATH_RAISES = "invalid device -1" in str(e)
        except Exception:  # another CuPy API than expected: take the Python path to be safe
            _C_PATH_RAISES = False
    return _C_PATH_RAISES


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


def install(pinned=True, typed_oom=False):
    """Make gpupool CuPy's device allocator (every device), and its pinned host allocator
    (`pinned=True`). Out of memory raises gpupool.cupy.OutOfMemoryError (a
    cupy.cuda.memory.OutOfMemoryError) with gpupool's report. Where CuPy does not pass the C
    allocator's error on (CuPy 14.2.0 does not), CPython wraps it in SystemError (as its
    `__cause__`) unless `typed_oom=True`, which then installs `python_allocator()` (one
    Python call per allocation) instead of the C path; where CuPy does, `typed_oom` keeps
    the C path, which already raises the typed error. See the module notes."""
    cupy = _framework("cupy", "gpupool.cupy.install()")
    alloc = allocator()
    if typed_oom and not c_allocator_raises_typed():
        alloc = python_allocator()
    cupy.cuda.set_allocator(alloc.malloc)
    if pinned:
        cupy.cuda.set_pinned_memory_allocator(pinned_malloc)
    _name_share_in_ipc_errors()
    # CuPy enables peer access itself, with no hook an allocator sees: every peer is granted
    # gpupool's memory, as `cudaMalloc` memory is readable by every enabled peer (docs/arena.md,
    # "Peers"; recorded only, no CUDA work here).
    _check(lib().gpupool_enable_peer_access(-1, -1, None))
    return alloc


# Process sharing: CuPy users share an array's memory with `runtime.ipcGetMemHandle`, which
# works on `cuMemAlloc` memory (the split pool) and fails with "invalid argument" on arena
# memory (the driver's virtual memory API). `share()` works on both, through
# `gpupool.share` (see that module): send what it returns through a multiprocessing queue
# or pipe, and the receiving process gets a `cupy.ndarray` over the same memory.


class SharedArray:
    """`share(a)`: pickles (multiprocessing's pickler) to a `cupy.ndarray` over `a`'s memory
    in the receiving process."""

    def __init__(self, a):
        import cupy
        _share.route_multiprocessing()
        self.mem = a.data.mem
        self.device = a.data.device_id
        with cupy.cuda.Device(self.device):
            # Recorded now, on the caller's current stream (pickling may happen on a queue's
            # feeder thread, whose current stream is another).
            self.event = cupy.cuda.Event(block=False, disable_timing=True, interprocess=True)
            self.event.record()
            handle = cupy.cuda.runtime.ipcGetEventHandle(self.event.ptr)
        self.meta = (a.shape, a.dtype.str, a.strides, a.data.ptr - self.mem.ptr, handle)

    def __reduce__(self):
        # Each pickling is one send, with a hold of its own.
        sent = _share.export(self.mem.ptr, self.mem.size, self.device, (self.mem, self.event))
        return (_open_shared, (sent, self.meta))


def share(a):
    """Send `a` (a `cupy.ndarray` whose memory is gpupool's) to another process: put what
    this returns on a multiprocessing queue (or pipe); the receiver gets a `cupy.ndarray`
    over the same memory, ordered after the work queued on `a` here. The memory stays
    allocated here until the receiver's last array over it is gone (`gpupool.share`)."""
    return SharedArray(a)


class _Import:
    """A mapping of another process's block here; closed when the last array over it goes."""

    def __init__(self, managed):
        self.managed = managed
        self.ptr = _share.dlpack_data(managed)

    def __del__(self):
        _share.delete_dlpack(self.managed)


_imports = weakref.WeakValueDictionary()  # (producer, its address, device) -> _Import
# A block open here already is let go when sent again, not opened ahead (`share._Ahead`).
_share.opened_here_checks.append(_imports.__contains__)


def _open_shared(sent, meta):
    import cupy
    shape, dtype, strides, offset, handle = meta
    key = (sent.producer, sent.ptr, sent.device)
    received = _share.Received(sent)
    imp = _imports.get(key)
    if imp is None:
        imp = _Import(received.open_dlpack(sent.device))
        _imports[key] = imp
        received = None
    try:
        with cupy.cuda.Device(sent.device):
            mem = cupy.cuda.UnownedMemory(imp.ptr, sent.size, imp, sent.device)
            ev = cupy.cuda.runtime.ipcOpenEventHandle(handle)
            try:
                cupy.cuda.runtime.streamWaitEvent(cupy.cuda.get_current_stream().ptr, ev)
            finally:
                cupy.cuda.runtime.eventDestroy(ev)
            return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, offset), strides)
    finally:
        # A send of a block already open here is let go only after the wait: letting go
        # lets the sender drop the send, and with it the event.
        if received is not None:
            received.let_go()


def _name_share_in_ipc_errors():
    """Make `cupy.cuda.runtime.ipcGetMemHandle` say, where it fails on gpupool's arena
    memory, that `gpupool.cupy.share` is the route."""
    import cupy.cuda.runtime as rt
    orig = getattr(rt, "_gpupool_orig_ipcGetMemHandle", rt.ipcGetMemHandle)

    class IpcError(rt.CUDARuntimeError):
        def __init__(self, status, text):
            super().__init__(status)
            self.args = (text,)

    def ipcGetMemHandle(ptr):
        try:
            return orig(ptr)
        except rt.CUDARuntimeError as e:
            raise IpcError(e.status, f"{e}: cudaIpcGetMemHandle cannot share gpupool's arena memory (GPUPOOL_POOL=arena, "
                                     "the default, maps memory with the driver's virtual memory API); send arrays to "
                                     "other processes with gpupool.cupy.share(array), or raw blocks with "
                                     "gpupool.ipc_export") from e
    ipcGetMemHandle.__doc__ = orig.__doc__
    rt._gpupool_orig_ipcGetMemHandle = orig
    rt.ipcGetMemHandle = ipcGetMemHandle


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
