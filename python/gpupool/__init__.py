"""gpupool: one caching GPU memory pool per device, shared by PyTorch, CuPy and C code.

Thin ctypes wrapper around libgpupool.so. Nothing here is on the per-allocation path:
PyTorch and CuPy call the library's C functions directly.

    import gpupool
    gpupool.torch.install()      # PyTorch allocates through gpupool
    gpupool.cupy.install()       # CuPy too: both share one pool per device
    print(gpupool.memory_status())
"""

import contextlib
import ctypes
import json
import operator
import os
import sys
import pathlib

__version__ = "0.1.0"   # the library's own (gpupool_version()) is checked to match

__all__ = ["GpupoolError", "library_path", "lib", "stats", "stats_json", "memory_status", "reclaim",
           "set_limit", "get_limit", "configure", "report_leaks", "torch", "cupy", "share", "snapshot"]

_HERE = pathlib.Path(__file__).resolve().parent
_LIB = None
_PATH = None


class GpupoolError(RuntimeError):
    """A gpupool call failed; `.status` is the numeric gpupool_status."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


def _candidates():
    """Where to look, in order: $GPUPOOL_LIBRARY (an override), the library bundled in this
    package (`pip install .` puts it here), and, in a source checkout only, the build folders."""
    env = os.environ.get("GPUPOOL_LIBRARY")
    if env:
        return [pathlib.Path(env)], True
    found = sorted(_HERE.glob("libgpupool*.so"))
    paths = found or [_HERE / "libgpupool.so"]
    repo = _HERE.parent.parent  # python/gpupool -> the repository root, in a source checkout
    if (repo / "Cargo.toml").is_file() and (repo / "python" / "gpupool") == _HERE:
        paths += [repo / "target" / "release" / "libgpupool.so", repo / "dist" / "libgpupool.so"]
    return paths, False


def library_path():
    """Where libgpupool.so is: $GPUPOOL_LIBRARY, inside this package, or a source checkout's build."""
    paths, from_env = _candidates()
    for p in paths:
        if p.is_file():
            return str(p)
    tried = "\n  ".join(str(p) for p in paths)
    hint = ("GPUPOOL_LIBRARY is set but names no file" if from_env else
            "install the package with `pip install .` at the repository root (it builds and bundles the "
            "library), or build it with `cargo build --release` and set GPUPOOL_LIBRARY to target/release/libgpupool.so")
    raise OSError(f"gpupool: libgpupool.so not found; looked for:\n  {tried}\n{hint}")


class Stats(ctypes.Structure):
    """gpupool_stats, layout version 2 (see include/gpupool.h)."""
    _fields_ = [("struct_size", ctypes.c_uint32), ("version", ctypes.c_uint32)] + [
        (name, ctypes.c_uint64) for name in (
            "used_bytes", "free_bytes", "total_bytes", "n_free_blocks", "n_live_blocks", "requested_bytes",
            "peak_used_bytes", "peak_total_bytes", "n_allocs", "n_frees", "n_upstream_allocs",
            "n_upstream_frees", "n_ooms", "n_reclaims", "reclaimed_bytes", "n_invalid_frees", "limit_bytes",
            "largest_free_block", "device_free_bytes", "device_total_bytes", "n_cross_stream_reuses",
            "n_deferred_frees", "peak_requested_bytes")]


def _signatures():
    """(name, restype, argtypes) of every C function this package calls through ctypes, as
    include/gpupool.h, gpupool_share.h and gpupool_plugin.h declare them
    (tests/python/test_signatures.py checks each against the headers). Not here:
    `gpupool_cupy_set_oom_error`, which no header declares (CuPy's error type is a Python
    object; `gpupool.cupy` declares it), and the functions whose addresses go to the
    frameworks rather than being called (`gpupool_cupy_malloc`, `gpupool_torch_*`)."""
    c_int, c_size, vp, cp = ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_char_p
    return [
        ("gpupool_malloc", c_int, [ctypes.POINTER(vp), c_size, c_int, vp]),
        ("gpupool_free", c_int, [vp, c_int, vp]),
        ("gpupool_get_stats", c_int, [c_int, ctypes.POINTER(Stats)]),
        ("gpupool_reclaim", c_int, [c_int, ctypes.POINTER(c_size)]),
        ("gpupool_enable_peer_access", c_int, [c_int, c_int, ctypes.POINTER(c_size)]),
        ("gpupool_tag_begin", c_int, [cp]),
        ("gpupool_tag_end", c_int, []),
        ("gpupool_tag_place", c_int, [cp, cp]),
        ("gpupool_tag_names", c_size, [ctypes.c_char_p, c_size]),
        ("gpupool_tag_pause", c_int, [c_int, cp, vp, c_int, ctypes.POINTER(c_size)]),
        ("gpupool_tag_resume", c_int, [c_int, cp, ctypes.POINTER(c_size)]),
        ("gpupool_tag_paused_bytes", c_int, [c_int, cp, ctypes.POINTER(c_size)]),
        ("gpupool_tag_drop_backup", c_int, [c_int, cp, ctypes.POINTER(c_size)]),
        ("gpupool_tag_prepare_backup", c_int, [c_int, cp, ctypes.POINTER(c_size)]),
        ("gpupool_reset_peak_stats", c_int, [c_int]),
        ("gpupool_set_limit", c_int, [c_int, c_size]),
        ("gpupool_set_limit_str", c_int, [c_int, cp]),
        ("gpupool_get_limit", c_int, [c_int, ctypes.POINTER(c_size)]),
        ("gpupool_memory_status", c_size, [c_int, cp, c_size]),
        ("gpupool_status_socket_path", c_size, [c_int, cp, c_size]),
        ("gpupool_stats_json", c_size, [c_int, cp, c_size]),
        ("gpupool_status_str", cp, [c_int]),
        ("gpupool_last_error", c_size, [cp, c_size]),
        ("gpupool_configure", c_int, [c_int, cp, cp]),
        ("gpupool_version", cp, []),
        ("gpupool_report_leaks", c_size, [cp, c_size]),
        ("gpupool_begin_allocate_to_pool", c_int, [c_int, ctypes.c_uint64, vp]),
        ("gpupool_end_allocate_to_pool", c_int, [c_int, ctypes.c_uint64]),
        ("gpupool_release_pool", c_int, [c_int, ctypes.c_uint64]),
        ("gpupool_release_capture", c_int, [c_int, ctypes.c_uint64]),
        ("gpupool_cupy_set_stream_getter", None, [vp]),
        ("gpupool_pinned_malloc", c_int, [ctypes.POINTER(vp), c_size, vp]),
        ("gpupool_pinned_free", c_int, [vp, vp]),
        ("gpupool_pinned_get_stats", c_int, [ctypes.POINTER(Stats)]),
        ("gpupool_snapshot_json", c_size, [c_int, cp, c_size]),
        ("gpupool_ipc_export", c_int, [vp, vp, c_size, ctypes.POINTER(c_size)]),
        ("gpupool_ipc_descriptor_fds", c_int, [cp, c_size, ctypes.POINTER(c_int), c_size, ctypes.POINTER(c_size)]),
        ("gpupool_ipc_open", c_int, [cp, c_size, c_int, ctypes.POINTER(c_int), c_size, ctypes.POINTER(vp)]),
        ("gpupool_ipc_close", c_int, [vp, c_int]),
        ("gpupool_ipc_export_flags", c_int, [vp, ctypes.c_uint32, vp, c_size, ctypes.POINTER(c_size)]),
        ("gpupool_ipc_open_dlpack", c_int, [cp, c_size, c_int, ctypes.POINTER(c_int), c_size, c_int,
                                            ctypes.c_uint32, ctypes.POINTER(vp)]),
        ("gpupool_dlpack_give_back_count", c_int, [vp, cp, c_size, ctypes.c_uint64]),
        ("gpupool_share_hold", c_int, [ctypes.POINTER(c_int), ctypes.POINTER(ctypes.c_uint32)]),
        ("gpupool_share_held", c_int, [ctypes.c_uint32, ctypes.POINTER(c_int)]),
        ("gpupool_share_held_count", c_size, []),
        ("gpupool_share_release", c_int, [c_int, ctypes.c_uint32]),
        ("gpupool_share_open_ahead", c_int, [c_size, cp, ctypes.POINTER(c_size), ctypes.POINTER(c_int),
                                             ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(c_int), ctypes.POINTER(c_size),
                                             ctypes.POINTER(vp)]),
        ("gpupool_share_take_ahead", c_int, [vp, c_size, ctypes.POINTER(vp)]),
        ("gpupool_share_end_ahead", c_int, [vp, c_int]),
        ("gpupool_share_ahead_json", c_size, [cp, c_size]),
        ("gpupool_handover_prepare", c_int, [c_int]),
        ("gpupool_handover_new", c_int, [vp, c_size, ctypes.POINTER(c_size)]),
        ("gpupool_handover_add", c_int, [cp, c_size, ctypes.POINTER(c_int), c_size, ctypes.c_uint32]),
        ("gpupool_handover_withdraw", c_int, [cp, c_size]),
        ("gpupool_handover_take", c_int, [cp, c_size, ctypes.POINTER(ctypes.POINTER(c_int)), ctypes.POINTER(c_size),
                                          ctypes.POINTER(ctypes.c_uint32)]),
        ("gpupool_handover_free_fds", None, [ctypes.POINTER(c_int)]),
    ]


def lib():
    """The loaded library (loaded once, RTLD_GLOBAL so every framework sees the same pool)."""
    global _LIB, _PATH
    if _LIB is None:
        _PATH = library_path()
        L = ctypes.CDLL(_PATH, mode=ctypes.RTLD_GLOBAL)
        for name, res, args in _signatures():
            f = getattr(L, name)
            f.restype, f.argtypes = res, args
        _LIB = L
    return _LIB


def _last_error():
    L = lib()
    n = L.gpupool_last_error(None, 0)
    buf = ctypes.create_string_buffer(n + 1)
    L.gpupool_last_error(buf, n + 1)
    return buf.value.decode(errors="replace")


def _check(status):
    if status != 0:
        raise GpupoolError(status, _last_error())


def _text(fn, device):
    n = fn(device, None, 0)
    buf = ctypes.create_string_buffer(n + 1)
    fn(device, buf, n + 1)
    return buf.value.decode(errors="replace")


def stats(device=0):
    """The device pool's counters as a dict (works while PyTorch's memory_stats() cannot)."""
    s = Stats()
    s.struct_size = ctypes.sizeof(Stats)
    _check(lib().gpupool_get_stats(device, ctypes.byref(s)))
    # An older library fills fewer fields (it stamps struct_size with what it wrote): only
    # those are reported.
    return {name: getattr(s, name) for name, _ in Stats._fields_[2:]
            if getattr(Stats, name).offset + getattr(Stats, name).size <= s.struct_size}


def reset_peak_stats(device=0):
    """Start the device's peaks (`peak_used_bytes`, `peak_total_bytes`,
    `peak_requested_bytes`) again from what is in use and reserved now."""
    _check(lib().gpupool_reset_peak_stats(device))


def memory_status(device=-1):
    """Human-readable report (device -1: every device in use)."""
    return _text(lib().gpupool_memory_status, device)


def stats_json(device=-1):
    """The same numbers as memory_status, parsed from gpupool_stats_json."""
    return json.loads(_text(lib().gpupool_stats_json, device))


def report_leaks():
    """Every live allocation, largest first; with GPUPOOL_DEBUG=2 each has its age, stream
    and the backtrace of the code that allocated it."""
    L = lib()
    n = L.gpupool_report_leaks(None, 0)
    buf = ctypes.create_string_buffer(n + 1)
    L.gpupool_report_leaks(buf, n + 1)
    return buf.value.decode(errors="replace")


def reclaim(device=-1):
    """Return cached memory to the driver; returns the bytes released."""
    n = ctypes.c_size_t(0)
    _check(lib().gpupool_reclaim(device, ctypes.byref(n)))
    return n.value


def enable_peer_access(device, peer):
    """Let GPU `peer` read and write the memory gpupool maps on GPU `device`, now and from
    now on (gpupool grants a peer only once asked, as PyTorch's expandable segments do;
    PyTorch's peer copies ask by themselves; -1 for either: every GPU, every peer). Returns
    the access grants made now."""
    n = ctypes.c_size_t(0)
    _check(lib().gpupool_enable_peer_access(int(device), int(peer), ctypes.byref(n)))
    return n.value


def set_limit(limit, device=0):
    """Cap the device pool's reserved memory: bytes, '8GiB', '512MB' or '50%'; 0 = no limit.
    Strings are parsed by the library, exactly as GPUPOOL_MEMORY_LIMIT is."""
    if isinstance(limit, str):
        _check(lib().gpupool_set_limit_str(device, limit.encode()))
        return
    try:
        limit = operator.index(limit)  # an int, or an integer type such as numpy's
    except TypeError:
        raise TypeError(f"gpupool.set_limit: a limit is bytes (an integer) or a string such as '8GiB' or '50%' "
                        f"(0 for no limit), not {type(limit).__name__}") from None
    # ctypes would wrap these silently: -5 to 16 EiB, 2**70 to some other number.
    if limit < 0 or limit >= 1 << 64:
        raise ValueError(f"gpupool: a limit is a number of bytes from 0 (no limit) to 2**64 - 1, not {limit}")
    _check(lib().gpupool_set_limit(device, limit))


def _framework(name, what):
    """Import framework `name` for `what` (an install call), saying what is missing if it is not
    installed rather than failing with a bare ModuleNotFoundError."""
    import importlib
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        pip = {"torch": "torch", "cupy": "cupy-cuda13x (or the CuPy build for your CUDA)"}[name]
        raise ModuleNotFoundError(f"{what} needs {name}, which is not installed in this Python "
                                  f"({sys.executable}): pip install {pip}", name=name) from None


def get_limit(device=0):
    n = ctypes.c_size_t(0)
    _check(lib().gpupool_get_limit(device, ctypes.byref(n)))
    return n.value


def configure(device=0, pool=None, upstream=None):
    """Choose the strategy ('split', 'binned', 'none', 'arena') and/or upstream ('device', 'vmm', 'managed',
    'async', 'host') of a device before (or between) uses."""
    enc = lambda v: None if v is None else v.encode()
    _check(lib().gpupool_configure(device, enc(pool), enc(upstream)))


def ipc_export(ptr):
    """The descriptor (bytes) of the live arena block at `ptr` (the default pool), for
    `ipc_open` in another process: send it any way (pipe, pickle). Keep the block allocated
    while others use it. This is the route for arena memory: cudaIpcGetMemHandle (CuPy's
    `cupy.cuda.runtime.ipcGetMemHandle`) refuses it with cudaErrorInvalidValue. Memory of
    the segment pools (GPUPOOL_POOL=split) is shared with cudaIpcGetMemHandle."""
    L, n = lib(), ctypes.c_size_t(0)
    _check(L.gpupool_ipc_export(ptr, None, 0, ctypes.byref(n)))
    buf = ctypes.create_string_buffer(n.value)
    _check(L.gpupool_ipc_export(ptr, buf, n.value, ctypes.byref(n)))
    return buf.raw[:n.value]


def ipc_descriptor_fds(desc):
    """The exporter's file descriptors behind `desc`, one per granule: what to pass to a
    child (`subprocess.Popen(pass_fds=...)` keeps their numbers) or send with
    `socket.send_fds` where the importer may not fetch them itself. They stay gpupool's."""
    L, n = lib(), ctypes.c_size_t(0)
    _check(L.gpupool_ipc_descriptor_fds(desc, len(desc), None, 0, ctypes.byref(n)))
    fds = (ctypes.c_int * n.value)()
    _check(L.gpupool_ipc_descriptor_fds(desc, len(desc), fds, n.value, ctypes.byref(n)))
    return list(fds)


def ipc_open(desc, device=0, fds=None):
    """Map a block another process exported (`ipc_export`) on `device`; returns its address
    here. `fds`: this process's copies of the exporter's descriptors (in
    `ipc_descriptor_fds` order, or each number of that list once, in the order of its first
    appearance: `list(dict.fromkeys(...))`); None fetches them from the exporter
    (pidfd_getfd)."""
    out = ctypes.c_void_p()
    arr = None if fds is None else (ctypes.c_int * len(fds))(*fds)
    _check(lib().gpupool_ipc_open(desc, len(desc), device, arr, 0 if fds is None else len(fds), ctypes.byref(out)))
    return out.value


def ipc_close(ptr, device=0):
    """Close what `ipc_open` returned (the exporter's memory is untouched). A block opened by
    fetching the exporter's descriptors stays mapped, kept for the exporter's next message,
    and the close does not wait for the device: finish your work on the block before you
    tell the exporter you are done (as with CUDA's own IPC handles)."""
    _check(lib().gpupool_ipc_close(ptr, device))


@contextlib.contextmanager
def tag(name):
    """Allocations this thread makes inside the block (PyTorch, CuPy, C: all through gpupool)
    come from tag `name`'s own memory, which `pause` gives back to the driver and `resume`
    restores at the same addresses (docs/tags.md). Tags nest."""
    _check(lib().gpupool_tag_begin(name.encode()))
    try:
        yield
    finally:
        _check(lib().gpupool_tag_end())


def place_tag(name, memory):
    """Choose what tag `name`'s memory is made of, before its first allocation (docs/tags.md,
    "A tag's memory"): "pausable" (the default: `pause` gives it back at kept addresses; sent
    as PyTorch's expandable segments) or "cuda-ipc" (`cudaMalloc` segments, sent as CUDA IPC
    handles that any receiver opens in any container; `pause` refuses it). Raises, changing
    nothing, while the tag holds memory."""
    if not isinstance(name, str) or not isinstance(memory, str):
        raise TypeError(f"gpupool.place_tag: a tag name and a memory kind are str, not {type(name).__name__} "
                        f"and {type(memory).__name__}")
    _check(lib().gpupool_tag_place(name.encode(), memory.encode()))


def named_tags():
    """Every tag this process named, in the order named: {name: memory} ("pausable" or
    "cuda-ipc", `place_tag`)."""
    n = lib().gpupool_tag_names(None, 0)
    while True:
        buf = ctypes.create_string_buffer(n + 1)
        need = lib().gpupool_tag_names(buf, n + 1)
        if need <= n:
            break
        n = need                          # a tag was named meanwhile
    lines = buf.value.decode().splitlines()
    return dict(line.split("\t", 1) for line in lines)


def _names(tags, what, device):
    """The tag names `tags` gives (a name or several), each one this process named: checked
    before any is acted on, so a bad name changes nothing. Returns them with the bytes each
    has paused now."""
    if isinstance(tags, str):
        names = [tags]
    else:
        try:
            names = list(tags)
        except TypeError:
            raise TypeError(f"gpupool.{what}: tags are a tag name or a list of names, not {type(tags).__name__}") from None
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"gpupool.{what}: a tag name is a str, not {type(name).__name__} ({name!r})")
    # paused_bytes raises, naming it, for a tag this process never named.
    return [(name, paused_bytes(name, device)) for name in names]


def _stream_handle(stream):
    """A CUDA stream as the library takes it: a handle, a PyTorch or CuPy stream object, or
    None for PyTorch's current stream where PyTorch is in use (else the legacy stream)."""
    if stream is None:
        import sys
        t = sys.modules.get("torch")
        if t is not None and t.cuda.is_initialized():
            return t.cuda.current_stream().cuda_stream
        return 0
    for attr in ("cuda_stream", "ptr"):
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    return int(stream)


def pause(tags=None, backup=True, device=-1, stream=None):
    """Give the device memory of `tags` (a name or several; None: every pausable tag this
    process named, then every pool's cached free memory) back to the driver, keeping every
    address: work queued on `stream` (default: PyTorch's current stream) finishes first
    (stream-ordered, no device-wide synchronize); contents are copied to page-locked host
    memory where `backup` says (True, False, or a dict of tag -> bool: weights kept, KV
    caches discarded). Returns the device bytes given back. Until `resume`, allocating under
    a paused tag or sharing its blocks raises, and frees of its blocks wait for the resume.
    All or nothing: every name is checked before any tag pauses, and a pause that fails
    midway resumes the tags this call paused (the error says which)."""
    everything = tags is None
    if everything:
        tags = [name for name, memory in named_tags().items() if memory == "pausable"]
    # A stream belongs to one device: with every device asked and no stream named, the
    # current device waits for PyTorch's current stream and the others (a paused device
    # counts as done) for their legacy streams; no other device's context is touched.
    targets = [(device, _stream_handle(stream))]
    if device == -1 and stream is None:
        import sys
        t = sys.modules.get("torch")
        if t is not None and t.cuda.is_initialized():
            targets = [(t.cuda.current_device(), t.cuda.current_stream().cuda_stream), (-1, 0)]
    total = 0
    done = []
    for name, before in _names(tags, "pause", device):
        keep = backup.get(name, True) if isinstance(backup, dict) else bool(backup)
        try:
            for d, handle in targets:
                n = ctypes.c_size_t(0)
                _check(lib().gpupool_tag_pause(d, name.encode(), handle, int(keep), ctypes.byref(n)))
                total += n.value
        except GpupoolError as e:
            # All or nothing: what this call paused before the failure is resumed.
            undone = [t for t in done + ([name] if before == 0 else []) if _resume_quietly(t, device)]
            raise GpupoolError(e.status, f"{e} (pausing {name!r}; "
                               f"{'resumed ' + ', '.join(map(repr, undone)) if undone else 'nothing else was paused'})") from None
        if before == 0:
            done.append(name)
    if everything:
        try:
            total += reclaim(device)
        except GpupoolError as e:
            raise GpupoolError(e.status, f"{e} (every tag is paused; only the cached memory was not given back)") from None
    return total


def _resume_quietly(name, device):
    """Resume tag `name` after a failed pause; whether it had paused memory to resume."""
    try:
        if paused_bytes(name, device) == 0:
            return False
        resume(name, device)
        return True
    except GpupoolError:
        return False


def resume(tags=None, device=-1):
    """Map device memory for paused `tags` (a name or several; None: every paused tag) again
    at the same addresses and restore their backups; tensors, CUDA graphs captured before
    the pause and other holders of those addresses go on. Out of memory leaves a tag paused
    (free memory, then resume again). Returns the bytes mapped."""
    if tags is None:
        tags = [name for name, memory in named_tags().items() if memory == "pausable"]
    total = 0
    for name, _ in _names(tags, "resume", device):
        n = ctypes.c_size_t(0)
        _check(lib().gpupool_tag_resume(device, name.encode(), ctypes.byref(n)))
        total += n.value
    return total


def paused_bytes(tag_name, device=-1):
    """Device bytes tag `tag_name` has paused."""
    n = ctypes.c_size_t(0)
    _check(lib().gpupool_tag_paused_bytes(device, tag_name.encode(), ctypes.byref(n)))
    return n.value


def prepare_backup(tag_name, device=-1):
    """Page-lock now the host memory the first pause of `tag_name` with a backup copies into,
    as large as the tag's memory: that pause then runs at copy speed instead of spending
    seconds page-locking first. Returns the buffer's bytes. It runs while the GIL is
    released, so a thread can do it while the program works
    (`threading.Thread(target=gpupool.prepare_backup, args=("weights",)).start()`);
    allocations under the tag wait meanwhile. Kept until `drop_backup`."""
    if not isinstance(tag_name, str):
        raise TypeError(f"gpupool.prepare_backup: a tag is a name (str), not {type(tag_name).__name__}")
    n = ctypes.c_size_t(0)
    _check(lib().gpupool_tag_prepare_backup(device, tag_name.encode(), ctypes.byref(n)))
    return n.value


def drop_backup(tag_name, device=-1):
    """Give back the page-locked host memory kept for tag `tag_name`'s next backup (kept
    after a resume, as the next pause needs it); returns its bytes."""
    n = ctypes.c_size_t(0)
    _check(lib().gpupool_tag_drop_backup(device, tag_name.encode(), ctypes.byref(n)))
    return n.value


def _socket_path(pid):
    """Where process `pid` answers status requests (GPUPOOL_STATUS_SOCKET=1): the library's
    rule (Note [The status socket] in status_socket.rs)."""
    return _text(lib().gpupool_status_socket_path, pid)


def _fn_address(name):
    return ctypes.cast(getattr(lib(), name), ctypes.c_void_p).value


from . import cupy, share, snapshot, torch  # noqa: E402  (submodules use the helpers above)
