"""PyTorch integration: gpupool as PyTorch's CUDA allocator.

Two routes, chosen by `install()`:

- **The allocator class** (default): gpupool's own `CUDAAllocator` (csrc/torch_allocator.cpp,
  Note [gpupool's PyTorch allocator]), compiled once against the installed PyTorch
  (gpupool/_torch_allocator.py) and installed with PyTorch's changeCurrentAllocator. Every
  part of PyTorch's allocator interface answers: cuDNN's benchmark mode, memory_stats() and
  its family, snapshots and memory history, MemPool, CUDA graphs, and torch.multiprocessing
  through PyTorch's own reductions. Out of memory raises torch.OutOfMemoryError with
  gpupool's report.
- **The plug-in route**, where the class cannot be built (no C++ compiler, ninja or CUDA
  headers; one warning says which) or GPUPOOL_TORCH_ALLOCATOR=0 asks for it:
  `CUDAPluggableAllocator` over the library's functions, every hook set. PyTorch's plug-in
  class refuses most of the interface, so here gpupool answers the `torch.cuda.memory_*`
  family from its own statistics (`answer_memory_api`), sends CUDA tensors through
  torch.multiprocessing with its own reductions (below), and out of memory is a plain
  RuntimeError carrying gpupool's report; cuDNN's benchmark mode, snapshots through
  PyTorch and MemPool are lost.

CUDA graphs: `torch.cuda.graph`, `torch.cuda.make_graphed_callables` and `MemPool` scopes
keep each graph's memory in a private pool of the library (docs/graphs.md).
`torch.compile(mode="reduce-overhead")` uses inductor's CUDA-graph *trees* by default, which
checkpoint private pools (`getCheckpointState`), which gpupool refuses; `install()`
switches inductor to its plain CUDA graphs (`torch._inductor.config.triton.cudagraph_trees
= False`), which capture through `torch.cuda.graph`.
"""

import importlib
import importlib.abc
import sys
import warnings

from . import _check, _fn_address, _framework, _torch_allocator, library_path, lib, share

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

_ROUTE = None       # "allocator" or "plugin" once install() has run
_CLASS_ERROR = None  # why the class could not be built, once tried


def route():
    """Which route `install()` took: "allocator" (gpupool's allocator class), "plugin"
    (PyTorch's plug-in class), or None before install()."""
    return _ROUTE


def allocator():
    """A CUDAPluggableAllocator over the library's functions with all hooks set (the plug-in
    route; install() takes it only where the allocator class cannot be built)."""
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
    # PyTorch's plug-in class has no peer-access hook: its peer copies would find arena
    # memory not granted to the peer. Every peer that can is granted, as before grants were
    # made on demand (recorded only: no CUDA work here).
    _check(lib().gpupool_enable_peer_access(-1, -1, None))
    return alloc


_INDUCTOR_CONFIG = "torch._inductor.config"


def _plain_cuda_graphs(config):
    config.triton.cudagraph_trees = False


class _OnImport(importlib.abc.MetaPathFinder):
    """Runs `then(module)` right after module `name` is first imported, through the loader
    that would have imported it. Each spec found gets a loader of its own (`_Then`), so a
    probe (`importlib.util.find_spec`) that imports nothing uses nothing up."""

    def __init__(self, name, then):
        self.name, self.then = name, then

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Then(spec.loader, self)
                return spec
        return None

    def remove(self):
        # A new list, not an edit of the old one: another thread's import may be walking
        # it, and an element removed under it would skip the finder after it.
        sys.meta_path = [f for f in sys.meta_path if f is not self]


class _Then(importlib.abc.Loader):
    """`inner`, then the hook's `then`; every other attribute is `inner`'s."""

    def __init__(self, inner, hook):
        self.inner, self.hook = inner, hook

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.inner
        self.inner.exec_module(module)
        self.hook.remove()
        try:
            self.hook.then(module)
        except Exception as e:  # a PyTorch without the setting: the import itself must not fail
            warnings.warn(f"gpupool: could not configure {self.hook.name} ({e})", RuntimeWarning, stacklevel=2)

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


def use_plain_cuda_graphs_in_compile():
    """Make torch.compile(mode="reduce-overhead") capture with torch.cuda.graph instead of
    CUDA-graph trees (which checkpoint private pools, which gpupool refuses). Importing
    inductor's configuration imports much of inductor, which a process that never
    compiles should not pay for: where it is not imported yet, the setting is made
    the moment it is."""
    if _INDUCTOR_CONFIG in sys.modules:
        # import_module waits for a module another thread is still executing.
        _plain_cuda_graphs(importlib.import_module(_INDUCTOR_CONFIG))
    elif not any(isinstance(f, _OnImport) and f.name == _INDUCTOR_CONFIG for f in sys.meta_path):
        sys.meta_path = [_OnImport(_INDUCTOR_CONFIG, _plain_cuda_graphs), *sys.meta_path]
    return True


# PyTorch's allocator settings (`PYTORCH_CUDA_ALLOC_CONF`, newer PyTorch also reads
# `PYTORCH_ALLOC_CONF`) configure the allocator gpupool replaces, so under gpupool they do
# nothing. A user who brings them hears once which gpupool setting does that job. The
# `pinned_*` keys configure PyTorch's pinned host allocator, which gpupool leaves in place:
# they still apply.
_ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_ALLOC_CONF_EQUIVALENTS = {
    "expandable_segments": "gpupool's default strategy, GPUPOOL_POOL=arena, maps memory on demand as expandable "
                           "segments do (GPUPOOL_POOL=split: PyTorch's segment layout)",
    "max_split_size_mb": "none needed: the arena stitches scattered free memory instead of splitting segments",
    "garbage_collection_threshold": "GPUPOOL_DECAY (cached memory above the recent peak goes back)",
    "per_process_memory_fraction": "GPUPOOL_MEMORY_LIMIT=<percent>% or gpupool.set_limit('<percent>%', device)",
    "backend": "GPUPOOL_UPSTREAM=async for memory from cudaMallocAsync's pools",
}
# Values that ask for what PyTorch does anyway: nothing is lost under gpupool.
_ALLOC_CONF_DEFAULTS = {("backend", "native"), ("expandable_segments", "false")}


def _alloc_conf_items(text):
    """`text`'s key:value items, split at the commas outside brackets (PyTorch's
    `roundup_power2_divisions:[256:1,512:2]` is one item)."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(text + ","):
        if c == "[":
            depth += 1
        elif c == "]":
            depth = max(depth - 1, 0)
        elif c == "," and depth == 0:
            items.append(text[start:i].strip())
            start = i + 1
    return [x for x in items if x]


def alloc_conf_warning(environ=None):
    """The one warning for PyTorch allocator settings in `environ` (default: os.environ)
    that gpupool replaces, naming each with its gpupool equivalent; None where there are none."""
    import os
    environ = os.environ if environ is None else environ
    notes = []
    for var in _ALLOC_CONF_VARIABLES:
        for item in _alloc_conf_items(environ.get(var, "")):
            key, _, value = (part.strip() for part in item.partition(":"))
            if key.startswith("pinned_") or (key, value.lower()) in _ALLOC_CONF_DEFAULTS:
                continue
            notes.append(f"{var} {item!r}: {_ALLOC_CONF_EQUIVALENTS.get(key, 'no gpupool equivalent')}")
    if not notes:
        return None
    return ("gpupool: PyTorch's allocator settings do not apply to gpupool's pool, which replaces that allocator; "
            "they are ignored. Their gpupool equivalents: " + "; ".join(notes) + ".")


def _install_class(compiled):
    """True once the allocator class is PyTorch's allocator; False where it cannot be built
    and the caller may fall back (warned once)."""
    global _CLASS_ERROR
    on, required = _torch_allocator.wanted(compiled)
    if not on:
        return False
    if _CLASS_ERROR is None:
        try:
            _torch_allocator.install()
            return True
        except Exception as e:
            _CLASS_ERROR = str(e)
            if required:
                raise RuntimeError(f"gpupool: compiled=True, but its PyTorch allocator could not be installed: "
                                   f"{_CLASS_ERROR}") from e
            warnings.warn(f"gpupool: installed through PyTorch's plug-in class, not as a full allocator: its allocator "
                          f"class could not be built ({_CLASS_ERROR}). Lost: cuDNN benchmark mode "
                          "(torch.backends.cudnn.benchmark raises), torch.cuda.MemPool, memory snapshots and history "
                          "through PyTorch, torch.OutOfMemoryError (out of memory is a RuntimeError); "
                          "torch.cuda.memory_stats() and its family are answered from gpupool's statistics. Install "
                          "a C++ compiler and ninja (or run `python -m gpupool build-torch` where they are), or set "
                          f"{_torch_allocator.ENV}=0 to choose this route without the warning.",
                          RuntimeWarning, stacklevel=3)
    if required:
        raise RuntimeError(f"gpupool: compiled=True, but its PyTorch allocator could not be installed: {_CLASS_ERROR}")
    return False


def install(compile_graphs=True, compiled=None):
    """Make gpupool PyTorch's CUDA allocator (call before PyTorch allocates on the GPU) and
    return PyTorch's handle of it (`torch.cuda.memory._get_current_allocator()`).
    `compiled`: None follows GPUPOOL_TORCH_ALLOCATOR (default: the allocator class, falling
    back to the plug-in route with a warning), True the class or an error, False the plug-in
    route. `compile_graphs`: route torch.compile's CUDA graphs through torch.cuda.graph (see
    the module notes). `route()` says which route was taken."""
    global _ROUTE
    torch = _framework("torch", "gpupool.torch.install()")
    lib()
    ignored = alloc_conf_warning()
    if ignored:
        warnings.warn(ignored, RuntimeWarning, stacklevel=2)
    if _install_class(compiled):
        _ROUTE = "allocator"
        m = torch.cuda.memory
        current = (getattr(m, "get_current_allocator", None) or m._get_current_allocator)()
    else:
        current = allocator()
        torch.cuda.memory.change_current_allocator(current)
        share_cuda_tensors()
        answer_memory_api()
        _ROUTE = "plugin"
    if compile_graphs:
        use_plain_cuda_graphs_in_compile()
    return current


# The `torch.cuda.memory_*` family on the plug-in route. PyTorch's functions all read
# `torch.cuda.memory.memory_stats_as_nested_dict` (PyTorch's plug-in class raises there), so
# answering that one, the resets and the snapshot answers memory_allocated(),
# max_memory_allocated(), memory_reserved(), max_memory_reserved(), memory_stats() and
# memory_summary(). The figures are the pool's, for every framework in the process; the
# pool keeps no per-size-class books, so everything is under "all" and "large_pool".

_STAT_KEYS = ("current", "peak", "allocated", "freed")
_accumulated_base = {}  # device -> the pool's counters at the last reset_accumulated_memory_stats


def memory_stats_nested(s, base=None):
    """PyTorch's nested memory statistics (`torch.cuda.memory_stats_as_nested_dict()`'s
    shape) from a `gpupool.stats()` dict `s`; `base`: the counters at the last reset of the
    accumulated figures."""
    base = base or {}

    def acc(name):
        return s.get(name, 0) - base.get(name, 0)

    def stat(current, peak, allocated=0, freed=0):
        return {"current": current, "peak": max(peak, current), "allocated": allocated, "freed": freed}

    segments = s["n_upstream_allocs"] - s["n_upstream_frees"]
    reclaimed = acc("reclaimed_bytes")
    reserved_since = s["total_bytes"] + reclaimed - base.get("total_bytes", 0)
    figures = {
        "allocation": stat(s["n_live_blocks"], s["n_live_blocks"], acc("n_allocs"), acc("n_frees")),
        "segment": stat(segments, segments, acc("n_upstream_allocs"), acc("n_upstream_frees")),
        "active": stat(s["n_live_blocks"], s["n_live_blocks"], acc("n_allocs"), acc("n_frees")),
        "inactive_split": stat(s["n_free_blocks"], s["n_free_blocks"]),
        "allocated_bytes": stat(s["used_bytes"], s["peak_used_bytes"]),
        "reserved_bytes": stat(s["total_bytes"], s["peak_total_bytes"], reserved_since, reclaimed),
        "active_bytes": stat(s["used_bytes"], s["peak_used_bytes"]),
        "inactive_split_bytes": stat(s["free_bytes"], s["free_bytes"]),
        "requested_bytes": stat(s["requested_bytes"], s.get("peak_requested_bytes", s["requested_bytes"])),
    }
    out = {}
    for name, st in figures.items():
        out[name] = {"all": st, "large_pool": dict(st), "small_pool": {k: 0 for k in _STAT_KEYS}}
    zero = {k: 0 for k in _STAT_KEYS}
    out.update({"num_alloc_retries": 0, "num_ooms": acc("n_ooms"), "oversize_allocations": dict(zero),
                "oversize_segments": dict(zero), "num_sync_all_streams": 0,
                "num_device_alloc": acc("n_upstream_allocs"), "num_device_free": acc("n_upstream_frees"),
                "max_split_size": -1})
    return out


def _device_index(device):
    import torch
    return torch.cuda._utils._get_device_index(device, optional=True)


def answer_memory_api():
    """Answer PyTorch's memory statistics, their resets and its snapshot from gpupool's
    figures (the plug-in route; `install()` calls this there). Idempotent."""
    import torch
    from . import reset_peak_stats, snapshot as snap, stats
    m = torch.cuda.memory
    if getattr(m.memory_stats_as_nested_dict, "_gpupool", False):
        return

    def memory_stats_as_nested_dict(device=None):
        d = _device_index(device)
        return memory_stats_nested(stats(d), _accumulated_base.get(d))

    def reset_peak_memory_stats(device=None):
        reset_peak_stats(_device_index(device))

    def reset_accumulated_memory_stats(device=None):
        d = _device_index(device)
        _accumulated_base[d] = stats(d)

    def _snapshot(device=None, *args, **kwargs):
        return snap.snapshot(-1 if device is None else _device_index(device))

    for name, fn in [("memory_stats_as_nested_dict", memory_stats_as_nested_dict),
                     ("reset_peak_memory_stats", reset_peak_memory_stats),
                     ("reset_accumulated_memory_stats", reset_accumulated_memory_stats),
                     ("_snapshot", _snapshot)]:
        fn._gpupool = True
        fn.__doc__ = getattr(getattr(m, name, None), "__doc__", None)
        setattr(m, name, fn)
        if hasattr(torch.cuda, name):
            setattr(torch.cuda, name, fn)


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


def mempool():
    """A torch.cuda.MemPool whose memory is gpupool's: a private pool of the library under the
    allocator class; on the plug-in route a pool over the plug-in allocator, inside which
    PyTorch caches. Use with `with torch.cuda.use_mem_pool(pool): ...`."""
    import torch
    if _ROUTE == "allocator":
        return torch.cuda.MemPool()
    return torch.cuda.MemPool(allocator()._allocator)
