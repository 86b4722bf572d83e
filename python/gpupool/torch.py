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

from . import _fn_address, _torch_oom, library_path, lib, share

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
    share_cuda_tensors()
    return alloc


# Process sharing. PyTorch sends a CUDA tensor to another process (torch.multiprocessing
# queues and pipes, `reductions.reduce_tensor`) by asking its allocator for an IPC handle
# of the storage's memory, which `CUDAPluggableAllocator` refuses for every plug-in
# ("does not yet support shareIPcHandle"). So after `install()` gpupool's own reductions
# take CUDA tensors and storages: the storage's block goes as a `share.Sent` (the block's
# descriptor, a hold, the file descriptors), with an interprocess CUDA event recorded on
# the current stream so the consumer's work follows the producer's queued writes; the
# consumer maps the block once per storage (views of one storage sent together, or sent
# again, share the mapping), rebuilds the tensor with the same offset, size, stride,
# dtype, class and `requires_grad`, and lets go when its last tensor over it goes. The
# producer keeps the storage until then (`share.collect`, also run by
# `torch.cuda.ipc_collect()`), so its memory is not reused while a consumer uses it.
# CPU tensors keep PyTorch's reductions.

_opened = {}  # (producer, its block address, device), or ("native", handle, offset, device) -> StorageWeakRef here


# Whether the block sent under a key may be open here already: its send is let go, so it
# is not opened ahead (`share._Ahead`; one whose storage has gone since is opened by its
# rebuild instead).
share.opened_here_checks.append(_opened.__contains__)


def share_cuda_tensors():
    """Route `torch.multiprocessing`'s pickling of CUDA tensors and storages through gpupool
    (`install()` calls this). Idempotent."""
    import torch
    import torch.multiprocessing  # noqa: F401  (PyTorch registers its reductions on import; ours go over them)
    from multiprocessing.reduction import ForkingPickler
    from torch.multiprocessing import reductions as R
    if getattr(R, "_gpupool_routed", False):
        return
    share.route_multiprocessing()
    import atexit
    atexit.register(_opened.clear)  # its weak references must go before torch does
    tensor_types = set(torch._tensor_classes) | {torch.Tensor, torch.nn.parameter.Parameter}
    for t in tensor_types:
        ForkingPickler.register(t, lambda x, _orig=R.reduce_tensor: _reduce_tensor(x, _orig))
    ForkingPickler.register(torch.UntypedStorage, lambda s: _reduce_storage(s, R.reduce_storage))
    ForkingPickler.register(torch.storage.TypedStorage, lambda s: _reduce_typed_storage(s, R.reduce_typed_storage))
    _receive_native_cuda_tensors(R)
    collect = torch.cuda.ipc_collect

    def ipc_collect():
        share.collect()
        return collect()
    ipc_collect.__doc__ = collect.__doc__
    torch.cuda.ipc_collect = ipc_collect
    R._gpupool_routed = True


def _send_storage(storage):
    """What a consumer needs to map `storage` (a CUDA UntypedStorage of gpupool memory)."""
    import torch
    device = storage.device.index
    nbytes = storage.nbytes()
    if nbytes == 0:
        return (None, 0, device, None)
    event, handle = _send_event(device)
    sent = share.export(storage.data_ptr(), nbytes, device, (storage, event))
    return (sent, nbytes, device, handle)


def _send_event(device):
    """An interprocess event on `device`'s current stream, and its handle: the consumer's
    stream waits for it before using what was sent. The sends of one message on one stream
    (`share.message_memo`) share one event, recorded at the first of them (which creates it
    on the stream's device) and again once the whole message is pickled
    (`share.at_message_end`), before `dumps` returns its bytes: that record follows all the work
    queued before any of the message's sends (a reducer's own kernels between two sends
    included), as PyTorch's event per send does, and the receiver waits only once the whole
    message has arrived. A record per send would cost the receiver more than the waits it
    saves: each is work of another process on the GPU, which the GPU switches to between
    the receiver's own kernels. A send outside a message (or made while one is unpickled)
    records its own event. Each send keeps its event alive."""
    import torch
    stream = torch.cuda.current_stream(device)
    memo = share.message_memo()
    key = ("event", device, stream.cuda_stream)
    got = memo.get(key) if memo is not None else None
    if got is None:
        event = torch.cuda.Event(enable_timing=False, blocking=False, interprocess=True)
        event.record(stream)
        got = (event, event.ipc_handle())
        # Shared only where the message's end records it again (not while a message is
        # unpickled: a send made there records its own).
        if memo is not None and share.at_message_end(lambda: event.record(stream)):
            memo[key] = got
    return got


def _current_raw_stream(device):
    import torch
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream


def _wait_event(device, handle):
    """Order `device`'s current stream after the sender's event `handle`, once per event and
    stream in a message (the sends of one message share their event, `_send_event`)."""
    import torch
    memo = share.message_memo()
    if memo is not None:
        key = ("waited", device, handle, _current_raw_stream(device))
        if key in memo:
            return
    torch.cuda.Event.from_ipc_handle(device, handle).wait(torch.cuda.current_stream(device))
    if memo is not None:
        memo[key] = True


def _storage_here(info):
    """The UntypedStorage over a sent block in this process (mapped once per block)."""
    import torch
    sent, nbytes, device, event = info
    if sent is None:
        return torch.UntypedStorage(0, device=torch.device("cuda", device))
    key = (sent.producer, sent.ptr, device)
    received = share.Received(sent)
    storage = _cached(key)
    if storage is not None:
        try:
            # The wait first: letting go lets the sender drop the send, and with it the event.
            _wait_event(device, event)
        finally:
            received.let_go()
        return storage
    managed = received.open_dlpack(device)
    try:
        storage = torch.from_dlpack(share.capsule(managed)).untyped_storage()
    except BaseException:
        share.delete_dlpack(managed)
        raise
    _remember(key, storage)
    _wait_event(device, event)
    return storage


def _cached(key):
    """The storage mapped here earlier under `key` (`_remember`), if it is still alive."""
    import torch
    ref = _opened.get(key)
    return None if ref is None or ref.expired() else torch.UntypedStorage._new_with_weak_ptr(ref.cdata)


def _remember(key, storage):
    """Keep a weak reference to a mapping made here, for later sends of the same block."""
    from torch.multiprocessing.reductions import StorageWeakRef
    _opened[key] = StorageWeakRef(storage)
    if len(_opened) > 1024 and len(_opened) & 1023 == 0:
        for k in [k for k, r in _opened.items() if r.expired()]:
            del _opened[k]


def _mine(storage):
    return storage.device.type == "cuda"


def _reduce_tensor(t, orig):
    if not t.is_cuda or t.is_sparse:
        return orig(t)
    if t.requires_grad and not t.is_leaf:
        raise RuntimeError("Cowardly refusing to serialize non-leaf tensor which requires_grad, since autograd does not "
                           "support crossing process boundaries.  If you just want to transfer the data, call detach() "
                           "on the tensor before serializing (e.g., putting it on the queue).")
    info = _send_storage(t.untyped_storage())
    return (_rebuild_tensor, (type(t), info, t.dtype, t.storage_offset(), tuple(t.size()), t.stride(), t.requires_grad))


def _rebuild_tensor(cls, info, dtype, offset, size, stride, requires_grad):
    return _tensor_over(cls, _storage_here(info), dtype, offset, size, stride, requires_grad)


def _tensor_over(cls, storage, dtype, offset, size, stride, requires_grad):
    import torch
    t = torch.empty((0,), dtype=dtype, device=storage.device).set_(storage, offset, size, stride)
    if cls is torch.nn.parameter.Parameter:
        return torch.nn.parameter.Parameter(t, requires_grad=requires_grad)
    t.requires_grad = requires_grad
    return t


def _reduce_storage(s, orig):
    if not _mine(s):
        return orig(s)
    return (_rebuild_storage, (_send_storage(s),))


def _rebuild_storage(info):
    return _storage_here(info)


def _reduce_typed_storage(s, orig):
    if not _mine(s):
        return orig(s)
    return (_rebuild_typed_storage, (_send_storage(s._untyped_storage), s.dtype))


def _rebuild_typed_storage(info, dtype):
    import torch
    return torch.storage.TypedStorage(wrap_storage=_storage_here(info), dtype=dtype, _internal=True)


# CUDA tensors from a process that does not use gpupool come through PyTorch's own route:
# its pickle names `torch.multiprocessing.reductions.rebuild_cuda_tensor`, which opens the
# sender's CUDA IPC handle through the current allocator, and `CUDAPluggableAllocator`
# refuses that for every plug-in ("does not yet support getIpcDevPtr"). So installing
# gpupool would stop a process from receiving tensors it received before. After
# `install()` that function opens the handle through gpupool instead (CUDA's own IPC, once
# per sender allocation, as the split pool's sends), with PyTorch's protocol: the wait on
# the sender's event, one reference count of the sender's per storage received, given back
# once the storage is gone here and this process's queued work is done.

_SHAREABLE_CUDA_MALLOC = ord("c")  # PyTorch's handle kinds: 'c' cudaMalloc memory, 'e' expandable segments
_CUDA_IPC_HANDLE_BYTES = 64


def _cuda_ipc_handle(storage_handle):
    """The 64-byte CUDA IPC handle in PyTorch's shareable handle (a version byte and a kind
    byte before it; a bare handle from older versions)."""
    h = bytes(storage_handle)
    if len(h) == _CUDA_IPC_HANDLE_BYTES:
        return h
    if len(h) == 2 + _CUDA_IPC_HANDLE_BYTES and h[1] == _SHAREABLE_CUDA_MALLOC:
        return h[2:]
    kind = chr(h[1]) if len(h) > 1 else "?"
    raise RuntimeError(
        f"gpupool: this CUDA tensor comes from a process whose PyTorch allocator shared it as kind {kind!r} "
        f"({len(h)}-byte handle); gpupool receives PyTorch's cudaMalloc handles (kind 'c'). A sender using "
        "expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) must turn them off, or use gpupool "
        "itself (gpupool.torch.install()), whose sends every gpupool process receives")


def _receive_native_cuda_tensors(R):
    orig = R.rebuild_cuda_tensor
    if getattr(orig, "_gpupool", False):
        return

    def rebuild_cuda_tensor(tensor_cls, tensor_size, tensor_stride, tensor_offset, storage_cls, dtype,
                            storage_device, storage_handle, storage_size_bytes, storage_offset_bytes, requires_grad,
                            ref_counter_handle, ref_counter_offset, event_handle, event_sync_required):
        if storage_handle is None or storage_size_bytes == 0:  # no memory: nothing to open
            return orig(tensor_cls, tensor_size, tensor_stride, tensor_offset, storage_cls, dtype, storage_device,
                        storage_handle, storage_size_bytes, storage_offset_bytes, requires_grad, ref_counter_handle,
                        ref_counter_offset, event_handle, event_sync_required)
        storage = _native_storage_here(storage_cls, storage_device, storage_handle, storage_size_bytes,
                                       storage_offset_bytes, ref_counter_handle, ref_counter_offset, event_handle,
                                       event_sync_required)
        return _tensor_over(tensor_cls, storage, dtype, tensor_offset, tuple(tensor_size), tuple(tensor_stride),
                            requires_grad)
    rebuild_cuda_tensor._gpupool = True
    # Pickled by reference under PyTorch's name, as the function it stands in for.
    rebuild_cuda_tensor.__module__, rebuild_cuda_tensor.__qualname__ = orig.__module__, orig.__qualname__
    R.rebuild_cuda_tensor = rebuild_cuda_tensor


# PyTorch's count of a CUDA IPC send lives in a shared-memory file of its
# RefcountedMapAllocator: 64 bytes of its own, then one int64 per send slot.
_COUNTS_AT = 64


def _native_storage_here(storage_cls, device, storage_handle, size, offset, ref_counter_handle, ref_counter_offset,
                         event_handle, event_sync_required):
    """The UntypedStorage over a block PyTorch's own route sent (mapped once per storage)."""
    import torch

    def give_back_now():
        storage_cls._release_ipc_counter(ref_counter_handle, ref_counter_offset, device=device)
    key = ("native", bytes(storage_handle), offset, device)
    storage = _cached(key)
    try:
        handle = None if storage is not None else _cuda_ipc_handle(storage_handle)
        if event_sync_required:
            # Also where the storage is open here already (PyTorch's own route skips it
            # there): the sender may have written to it since.
            torch.cuda.Event.from_ipc_handle(device, event_handle).wait(torch.cuda.current_stream(device))
        if storage is None:
            managed = share.open_cuda_ipc_handle(handle, offset, size, device)
    except BaseException:
        give_back_now()  # nothing here holds the block: the sender may free it
        raise
    if storage is not None:
        # Counted once per storage here: this send's count goes back at once, as PyTorch does.
        give_back_now()
        return storage
    try:
        share.give_back_count(managed, ref_counter_handle, _COUNTS_AT + 8 * ref_counter_offset)
    except BaseException:
        share.delete_dlpack(managed)
        give_back_now()
        raise
    try:
        t = torch.from_dlpack(share.capsule(managed))
    except BaseException:
        share.delete_dlpack(managed)  # closes the import and gives the count back
        raise
    storage = t.untyped_storage()
    _remember(key, storage)
    return storage


def mempool(typed_oom=None):
    """A torch.cuda.MemPool whose segments come from gpupool; PyTorch caches inside it.
    Use with `with torch.cuda.use_mem_pool(pool): ...`. `typed_oom`: see allocator()."""
    import torch
    return torch.cuda.MemPool(allocator(typed_oom)._allocator)
