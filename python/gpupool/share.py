"""Sharing gpupool blocks with other processes the way the frameworks do, whatever the
framework: the part of `gpupool.torch`'s `torch.multiprocessing` route and of
`gpupool.cupy.share` that knows nothing of tensors.

A send (`export`) is the block's descriptor (`gpupool.ipc_export`, granules shared: small
blocks share their granule with others, as PyTorch's own IPC shares whole segments), a
*hold* (a slot in this process's holds file that the importer clears when it lets go, so
the block is not freed and reused while another process uses it), and the file
descriptors behind both. The descriptors travel the way `torch.multiprocessing` sends
CPU tensors' file descriptors, over a Unix socket (`SCM_RIGHTS`) from a thread of the
sending process to the process that unpickles the send, but the thread is the library's
(`gpupool_handover_*`, `src/share/handover.rs`): it needs no interpreter lock, and a receiver
keeps one connection per sender, so a handover costs a request and a reply instead of a
new authenticated connection answered by a Python thread. The socket answers only the
same user, and a handover only whoever has its random key, which travels inside the
message. (Where the library's thread cannot start, multiprocessing's resource sharer
carries the handover.) No ptrace right is needed, unlike fetching them by pid.

The importer (`Received.open_dlpack`) maps the block and gets a DLPack tensor whose
deleter (in the library, no Python) closes the mapping and clears the hold when the
framework drops its last tensor over it. The exporter keeps what it was asked to keep
(the framework's storage) until it finds the hold cleared: `collect()`, which runs every
so often as more is sent, from `torch.cuda.ipc_collect()` once `gpupool.torch.install()`
ran, and at exit, where anything still held is warned about.
"""

import atexit
import ctypes
import errno
import json
import os
import socket
import struct
import sys
import threading
import time
import uuid
from collections import namedtuple

from . import GpupoolError, _check, _last_error, ipc_descriptor_fds, lib

SHARE_GRANULES = 1

# This process among exporters: importers key what they have open by it (a pid is reused).
PRODUCER = uuid.uuid4().hex

_lock = threading.Lock()
_sent = {}          # hold slot -> what keeps the block alive until the importer lets go
_next_collect = 64  # collect when this many sends are outstanding
_FDS_PER_MESSAGE = 250  # the kernel passes at most 253 descriptors per SCM_RIGHTS message


class Fds:
    """File descriptors that travel inside a pickle to the one process that unpickles it.
    Made while multiprocessing pickles a message (its queues, pipes,
    `ForkingPickler.dumps`), every send in the message goes in one handover (`_Bundle`),
    each descriptor once; otherwise each on its own."""

    def __init__(self, fds, hold=None):
        bundle = getattr(_scope, "bundle", None) or _Bundle()
        self.at = tuple(bundle.add(fds, hold))
        self.ident = bundle.ident

    def __reduce__(self):
        return (_fds_from, (self.ident, self.at))

    def detach(self):
        """This send's descriptors here and who lends them: `(fds, lender)`. With a lender,
        the descriptors are the handover's, shared with the other sends of the message:
        use them, then call `lender.done()` (once; do not close them). Without, they are
        the caller's to close."""
        with _lock:
            got = _received.get(self.ident)
            if got is None:
                got = _received[self.ident] = _Received(self.ident)
        fds, lent = got.take(self.at)
        return fds, (got if lent else None)


def _fds_from(ident, at, n=None):
    # A process that receives sends routes its own messages too (from the next one on:
    # this one is being unpickled already).
    route_multiprocessing()
    f = Fds.__new__(Fds)
    # (A send from a sender before handovers held each descriptor once: a start and a count.)
    f.ident, f.at = ident, tuple(range(at, at + n)) if n is not None else at
    return f


# .bundle: the handover of the message being pickled on this thread; .fetched: the
# handovers fetched while unpickling a message on this thread; .memo: `message_memo()`.
_scope = threading.local()


def message_memo():
    """A dict that lives while multiprocessing pickles or unpickles one message on this
    thread (None outside one): what the sends of one message can share, as one event
    recorded for all of them by the sender and waited for once by the receiver."""
    return getattr(_scope, "memo", None)


_AT_END = object()  # message_memo() key: what at_message_end() was given


def at_message_end(fn):
    """Call `fn()` once the message being pickled on this thread is complete, before
    `ForkingPickler.dumps` returns its bytes (what multiprocessing sends). False where no
    message is being pickled (or one is being unpickled): the caller does the work itself.
    (Bytes a reducer writes itself, with a pickler of its own, are not covered.)"""
    memo = message_memo()
    if memo is None or "unpickling" in memo:
        return False
    memo.setdefault(_AT_END, []).append(fn)
    return True


def _new_ticket():
    """A new handover of the library's descriptor thread (`gpupool_handover_new`): its
    ticket, or None where the thread could not start (multiprocessing's resource sharer
    carries the handover then)."""
    L, n = lib(), ctypes.c_size_t(0)
    if L.gpupool_handover_new(None, 0, ctypes.byref(n)) != 0:
        return None
    buf = ctypes.create_string_buffer(n.value)
    _check(L.gpupool_handover_new(buf, n.value, ctypes.byref(n)))
    return buf.raw[:n.value]


class _Bundle:
    """The descriptors of one message's sends, in one handover taken by whoever unpickles
    the message. The library's descriptor thread hands them over (`gpupool_handover_*`:
    no interpreter lock on either side, one kept connection per sender and receiver);
    where it cannot run, multiprocessing's resource sharer does (a connection per
    handover, answered by a Python thread). Opened when the first send is added (the
    importer asks only once the message has arrived, so later ones go along). Each
    descriptor goes once however many sends name it (the holds file goes with every send;
    blocks in one chunk name the same one)."""

    def __init__(self):
        self.at = {}     # the library's descriptor number -> its index in the handover
        self.sends = 0
        self.holds = []  # (holds descriptor, slot) of each send, released if never sent
        self.sent = []   # the message's sends as pickled (`Sent`), listed ahead of its bytes (`_Ahead`)
        self.ident = None  # the ticket (bytes), or the resource sharer's (address, key)
        self.fds = []    # (resource sharer) this process's copies, one per descriptor

    def add(self, fds, hold=None):
        """Where each of `fds` (the library's descriptors) is in this handover. A number seen
        earlier in the same handover still names the same file: the library closes a
        descriptor only when its memory goes (or, the holds file, never), and the block of
        every send in the handover stays allocated, held, until its importer lets go."""
        if self.ident is None:
            self.ident = _new_ticket()
            if self.ident is None:
                from multiprocessing import resource_sharer
                self.ident = resource_sharer._resource_sharer.register(self._send, self._close)
        new, seen = [], {}
        for f in fds:
            if f not in self.at and f not in seen:
                seen[f] = len(self.at) + len(new)
                new.append(f)
        if isinstance(self.ident, bytes):
            arr = (ctypes.c_int * len(new))(*new)
            _check(lib().gpupool_handover_add(self.ident, len(self.ident), arr, len(new), 1))  # copies them
        else:
            copies = []
            try:
                for f in new:
                    copies.append(os.dup(f))
            except BaseException:
                for c in copies:
                    os.close(c)
                raise
            self.fds += copies
        self.at.update(seen)
        self.sends += 1
        if hold is not None:
            self.holds.append(hold)
        return [self.at[f] for f in fds]

    def _send(self, conn, _pid):
        from multiprocessing import reduction
        conn.send((len(self.fds), self.sends))
        with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:
            for i in range(0, len(self.fds), _FDS_PER_MESSAGE):
                reduction.sendfds(s, self.fds[i:i + _FDS_PER_MESSAGE])

    def _close(self):
        for f in self.fds:
            os.close(f)
        self.fds = []

    def drop(self):
        """The message was never sent: withdraw the handover (its descriptors close) and
        release the sends' holds (no importer will), so their blocks can be freed."""
        if isinstance(self.ident, bytes):
            lib().gpupool_handover_withdraw(self.ident, len(self.ident))
        elif self.ident is not None:
            from multiprocessing import resource_sharer
            resource_sharer._resource_sharer._cache.pop(self.ident[1], None)
        self._close()
        for fd, slot in self.holds:
            # Released, found released (which gives the slot back to the library) and
            # forgotten in one step under the lock: an export on another thread cannot take
            # the slot in between and have its storage forgotten in its place.
            with _lock:
                lib().gpupool_share_release(fd, slot)
                try:
                    _held(slot)
                except GpupoolError:
                    pass  # already given back
                kept = _sent.pop(slot, None)
            del kept  # the framework's storage goes here, outside the lock
        self.holds = []


def _fetch(ident):
    """A handover's descriptors, and how many sends share them (None: a sender before
    handovers held each descriptor once, one send's each)."""
    if isinstance(ident, bytes):
        L = lib()
        arr, n, sends = ctypes.POINTER(ctypes.c_int)(), ctypes.c_size_t(0), ctypes.c_uint32(0)
        _check(L.gpupool_handover_take(ident, len(ident), ctypes.byref(arr), ctypes.byref(n), ctypes.byref(sends)))
        try:
            return arr[:n.value], sends.value
        finally:
            L.gpupool_handover_free_fds(arr)
    from multiprocessing import reduction, resource_sharer
    out = []
    with resource_sharer._resource_sharer.get_connection(ident) as conn:
        n = conn.recv()
        n, sends = n if isinstance(n, tuple) else (n, None)
        with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:
            while len(out) < n:
                out += reduction.recvfds(s, min(_FDS_PER_MESSAGE, n - len(out)))
    return out, sends


class _Received:
    """A handover's descriptors here: fetched once, by the first of its sends to be taken
    (whichever thread), lent to each send (no copies) until every send is done with them,
    closed then."""

    def __init__(self, ident):
        self.ident = ident
        self.lock = threading.Lock()
        self.fds = None
        self.sends = None
        self.left = 0
        self.given = set()  # (a sender before handovers held each descriptor once) indices handed out
        self.closed = False
        self.error = None   # why the fetch failed, for every send of the handover

    def _fetched(self):
        """(Under `self.lock`.) Fetch the handover if no send did yet."""
        if self.error is not None:
            raise self.error
        if self.closed:
            raise GpupoolError(2, "gpupool: a shared block's descriptors were taken already, or its message "
                                  "failed to unpickle: a send opens once")
        if self.fds is None:
            try:
                self.fds, self.sends = _fetch(self.ident)
            except BaseException as e:
                # The sender serves a handover once: its other sends fail the same way.
                self.error = e
                self._close()
                raise
            self.left = len(self.fds) if self.sends is None else self.sends
            fetched = getattr(_scope, "fetched", None)
            if fetched is not None:
                fetched.append(self)

    def peek(self, at):
        """The descriptors at `at` (None: all), fetched if no send did yet, without taking
        them (each send still takes its own): for opening sends ahead (`_Ahead`), which
        copies them at once."""
        with self.lock:
            self._fetched()
            return list(self.fds) if at is None else [self.fds[i] for i in at]

    def take(self, at):
        """The descriptors at `at` and whether they are lent (see `Fds.detach`)."""
        with self.lock:
            self._fetched()
            mine = [self.fds[i] for i in at]
            if self.sends is not None:
                return mine, True
            # Each descriptor is one send's: handed over as it is.
            self.given.update(at)
            self.left -= len(at)
            if self.left <= 0:
                self._close()
            return mine, False

    def done(self):
        """A send that was lent descriptors is done with them."""
        with self.lock:
            self.left -= 1
            if self.left <= 0 and not self.closed:
                self._close()

    def abandon(self):
        """The message these sends came in failed to unpickle: the sends not taken yet
        never will be."""
        with self.lock:
            if not self.closed:
                self._close()

    def _close(self):
        """(Under `self.lock`.) Close what is left here (not what was handed out) and
        forget the handover."""
        for i, f in enumerate(self.fds or []):
            if i not in self.given:
                os.close(f)
        self.fds = []
        self.closed = True
        with _lock:
            if _received.get(self.ident) is self:
                del _received[self.ident]


_received = {}  # handover -> its descriptors here, while some send in it has not taken its own


def _dumps_in_one_handover(orig):
    """`ForkingPickler.dumps` with every send of the message in one handover."""
    def dumps(cls, obj, protocol=None):
        # A message pickled while another is (a reducer's own `dumps`) is a message of its
        # own: its handover must not be withdrawn if the outer one fails.
        outer, outer_memo = getattr(_scope, "bundle", None), getattr(_scope, "memo", None)
        bundle = _scope.bundle = _Bundle()
        memo = _scope.memo = {}
        try:
            got = orig(cls, obj, protocol)
            for fn in memo.get(_AT_END, ()):
                fn()
            if len(bundle.sent) >= _AHEAD_FROM and ahead_enabled():
                # The sends listed ahead of the message, for the receiver to open while it
                # unpickles the rest (`_Ahead`).
                got = orig(cls, _ListedAhead(bundle.ident, bundle.sent, got), protocol)
            return got
        except BaseException:
            bundle.drop()
            raise
        finally:
            _scope.bundle, _scope.memo = outer, outer_memo
    dumps._gpupool = True
    return classmethod(dumps)


def _loads_closing_on_failure(orig):
    """`ForkingPickler.loads` that, when unpickling a message fails partway, closes the
    handovers its sends opened: the sends after the failure are never taken."""
    def loads(*args, **kwargs):
        outer, outer_memo = getattr(_scope, "fetched", None), getattr(_scope, "memo", None)
        fetched = _scope.fetched = []
        _scope.memo = {"unpickling": True}
        try:
            got = orig(*args, **kwargs)
        except BaseException:
            for r in fetched:
                r.abandon()
            raise
        finally:
            _scope.fetched, _scope.memo = outer, outer_memo
        if outer is not None:
            outer.extend(fetched)  # a message inside a message: the outer one may still fail
        return got
    loads._gpupool = True
    # Picklable by reference, as the function it stands in for.
    loads.__module__, loads.__qualname__ = "multiprocessing.reduction", "ForkingPickler.loads"
    return staticmethod(loads)


def route_multiprocessing():
    """Make multiprocessing's pickler put every send of one message in one handover, and
    its unpickler close a handover whose message failed to unpickle (`torch.multiprocessing`
    and `gpupool.cupy.share` call this). Idempotent."""
    from multiprocessing.reduction import ForkingPickler
    if getattr(ForkingPickler.dumps, "_gpupool", False):
        return
    ahead_enabled()  # a malformed GPUPOOL_SHARE_AHEAD is said here, before anything is sent
    # Now, not inside the first handovers: the file limit, the kernel's file table, the
    # descriptor thread (gpupool_handover_prepare says why).
    lib().gpupool_handover_prepare(1)
    ForkingPickler.dumps = _dumps_in_one_handover(ForkingPickler.dumps.__func__)
    ForkingPickler.loads = _loads_closing_on_failure(ForkingPickler.loads)


# What travels: the exporter (`PRODUCER`), the block's address and size there (the key an
# importer caches by), its device, the descriptor, the hold's slot, the descriptors (the
# holds file's first, then one per allocation under the block, in the order the
# descriptor's granules first name them: the library spreads them over the granules, so
# nothing here works granule by granule), the sender's pid, and `order`, None. (A sender
# before that sent per granule of the descriptor which of those allocations' descriptors
# it is, or one descriptor per granule: both still open.)
class Sent(namedtuple("Sent", "producer ptr size device desc slot fds pid order", defaults=(None,))):
    __slots__ = ()

    def __reduce__(self):
        # Pickled into a message whose handover carries its descriptors: listed ahead of
        # the message's bytes too (`_ListedAhead`).
        bundle = getattr(_scope, "bundle", None)
        if bundle is not None and isinstance(self.fds, Fds) and self.fds.ident == bundle.ident:
            bundle.sent.append(self)
        return (Sent, tuple(self))


def _export_bytes(ptr):
    L, n = lib(), ctypes.c_size_t(0)
    _check(L.gpupool_ipc_export_flags(ptr, SHARE_GRANULES, None, 0, ctypes.byref(n)))  # the length only
    buf = ctypes.create_string_buffer(n.value)
    _check(L.gpupool_ipc_export_flags(ptr, SHARE_GRANULES, buf, n.value, ctypes.byref(n)))
    return buf.raw[:n.value]


def export(ptr, size, device, keep):
    """A `Sent` of the live gpupool block at `ptr` (its start, as allocated) for one other
    process; `keep` (the framework's storage, ...) stays referenced here until that process
    lets go of the block (`collect`)."""
    global _next_collect
    desc = _export_bytes(ptr)
    L = lib()
    hfd, slot = ctypes.c_int(), ctypes.c_uint32()
    # The slot is taken and its storage kept in one step under the lock, as `collect` finds
    # slots released and forgets their storages in one: neither sees the other half-done.
    with _lock:
        _check(L.gpupool_share_hold(ctypes.byref(hfd), ctypes.byref(slot)))
        _sent[slot.value] = keep
    try:
        uniq = list(dict.fromkeys(ipc_descriptor_fds(desc)))  # first-named order, repeats left out
        fds = Fds([hfd.value] + uniq, hold=(hfd.value, slot.value))
        sent = Sent(PRODUCER, ptr, size, device, desc, slot.value, fds, os.getpid())
    except BaseException:
        with _lock:  # nobody will release it: let the slot go
            L.gpupool_share_release(hfd.value, slot.value)
            _held(slot.value)
            kept = _sent.pop(slot.value, None)
        del kept  # outside the lock
        raise
    with _lock:
        due = len(_sent) >= _next_collect
    if due:
        collect()
        with _lock:
            _next_collect = max(64, 2 * len(_sent))
    return sent


_fd_limit_raised = False


def _raise_fd_limit():
    """Raise this process's soft limit on open files to its hard limit, once: a block
    arrives with one descriptor per allocation under it (the library's handover set-up,
    which also grows the table of open files once)."""
    global _fd_limit_raised
    if _fd_limit_raised:
        return
    _fd_limit_raised = True
    lib().gpupool_handover_prepare(0)


def _held(slot):
    h = ctypes.c_int()
    _check(lib().gpupool_share_held(slot, ctypes.byref(h)))
    return h.value == 1


def _still_held(slot):
    """Whether `slot` is still held; a slot the library no longer knows (given back through
    another path) counts as released, so one error cannot stop every later collect."""
    try:
        return _held(slot)
    except GpupoolError:
        return False


def collect():
    """Drop what was kept for sends whose importers let go (their blocks can be freed and
    reused). Returns how many sends are still held."""
    # Found released and forgotten in one step under the lock: the library gives a slot
    # found released back at once, and an export on another thread (multiprocessing pickles
    # on its queue's feeder thread) must not take it and have its storage forgotten here.
    with _lock:
        released = [s for s in list(_sent) if not _still_held(s)]
        kept = [_sent.pop(s) for s in released]
        left = len(_sent)
    del kept  # the framework's storages go here, outside the lock
    return left


def outstanding():
    """Sends of this process that other processes still hold (as last collected)."""
    with _lock:
        return len(_sent)


class Received:
    """A `Sent` on the importing side: its descriptors, taken from the exporter once."""

    def __init__(self, sent):
        self.sent = sent
        self.lender = None
        _raise_fd_limit()
        try:
            self.fds, self.lender = sent.fds.detach()
        except GpupoolError as e:
            if "is gone" not in str(e):
                raise
            raise GpupoolError(e.status, f"gpupool: the process that shared this block (pid {sent.pid}) is gone or no "
                                         f"longer hands out its file descriptors ({e}); a block can be received only "
                                         "while its sender lives, once") from e
        except (OSError, EOFError) as e:
            if getattr(e, "errno", None) == errno.EMFILE:
                raise GpupoolError(2, f"gpupool: receiving a shared block from process {sent.pid} needs more open files "
                                      f"than this process may have ({e}); raise the limit (ulimit -n)") from e
            raise GpupoolError(2, f"gpupool: the process that shared this block (pid {sent.pid}) is gone or no longer "
                                  f"hands out its file descriptors ({type(e).__name__}: {e}); a block can be received "
                                  "only while its sender lives, once, by a process multiprocessing started from the "
                                  "sender's process tree") from e

    def let_go(self):
        """This process already has the block open (an earlier send): release this send's
        hold at once and close the descriptors."""
        try:
            try:
                managed = _Ahead.take_current(self.sent)
            except GpupoolError:
                managed = None  # the import made ahead failed, its hold is still this send's
            if managed is not None:
                delete_dlpack(managed)  # an import made ahead after all: its deleter releases the hold
            else:
                _check(lib().gpupool_share_release(self.fds[0], self.sent.slot))
        finally:
            self.close()

    def open_dlpack(self, device):
        """Map the block on `device`; returns a `DLManagedTensor*` (an int) whose deleter
        closes the mapping and releases the hold. The descriptors are closed either way."""
        try:
            try:
                managed = _Ahead.take_current(self.sent)
            except GpupoolError:
                # The import made ahead failed, as this open would have: its hold is still
                # this send's, and nobody else will release it.
                lib().gpupool_share_release(self.fds[0], self.sent.slot)
                raise
            if managed is not None:
                return managed
            uniq = self.fds[1:]
            order = self.sent.order
            gran = uniq if order is None else [uniq[j] for j in order]
            arr = (ctypes.c_int * len(gran))(*gran)
            out = ctypes.c_void_p()
            st = lib().gpupool_ipc_open_dlpack(self.sent.desc, len(self.sent.desc), device, arr, len(gran),
                                               self.fds[0], self.sent.slot, ctypes.byref(out))
            if st != 0:
                # Nothing was mapped, so nothing here will ever release this send's hold:
                # release it now, or the sender keeps the block until it exits.
                err = GpupoolError(st, _last_error())
                lib().gpupool_share_release(self.fds[0], self.sent.slot)
                raise err
            return out.value
        finally:
            self.close()

    def close(self):
        fds, self.fds = self.fds, []
        if self.lender is not None:
            lender, self.lender = self.lender, None
            lender.done()
        else:
            for f in fds:
                os.close(f)


_AHEAD_FROM = 2  # sends in a message from which they are listed ahead of it (one has nothing to overlap)
_ahead_enabled = None
# What a framework route that keeps what it opened (`gpupool.torch`, `gpupool.cupy`) adds:
# whether the block with this key (producer, address there, device) may be open here
# already, so a send of it is not opened ahead (its rebuild lets it go, or opens it).
opened_here_checks = []
# What opening ahead did in this process: batches started, sends listed to their threads,
# imports taken by rebuilds, and seconds spent starting batches (of it: fetching their
# descriptors, listing what to open, and the library's call that copies them and starts
# the thread), taking (waiting for) imports and ending batches. `ahead_costs()`: the
# library's side.
ahead_counts = {"batches": 0, "listed": 0, "taken": 0, "start_s": 0.0, "fetch_s": 0.0, "list_s": 0.0, "open_s": 0.0,
                "take_s": 0.0, "end_s": 0.0}


def ahead_costs():
    """The library's side of opening ahead, as a dict (`gpupool_share_ahead_json`): batches,
    seconds from a batch's start to its thread's first line, spent opening, and waited for
    by rebuilds; and the arena imports this process made on a GPU, with seconds by kind of
    driver call."""
    L = lib()
    n = L.gpupool_share_ahead_json(None, 0)
    while True:
        # Room to spare: a figure may gain digits between the two calls.
        buf = ctypes.create_string_buffer(n + 64)
        n = L.gpupool_share_ahead_json(buf, len(buf))
        if n < len(buf):
            return json.loads(buf.value.decode())


def ahead_enabled():
    """Whether messages list their sends ahead of their bytes and receivers open them while
    unpickling the rest (`GPUPOOL_SHARE_AHEAD`: 1, the default, or 0)."""
    global _ahead_enabled
    if _ahead_enabled is None:
        v = os.environ.get("GPUPOOL_SHARE_AHEAD", "1").strip()
        if v not in ("0", "1"):
            raise GpupoolError(2, f"gpupool: GPUPOOL_SHARE_AHEAD={v!r}: expected 1 (open a message's sends ahead, "
                                  "the default) or 0")
        _ahead_enabled = v == "1"
    return _ahead_enabled


class _ListedAhead:
    """A message (its pickled bytes) with its sends listed before them: the receiver starts
    opening the sends on a thread of the library (`_Ahead`), then unpickles the message,
    whose rebuilds take those imports instead of making them. Each send is listed as plain
    values, which unpickle fast: (producer, address, device, slot, where its descriptors are
    in the handover `ident`, its granules' order, its descriptor)."""

    def __init__(self, ident, sents, payload):
        self.ident, self.payload = ident, payload
        self.sends = tuple((s.producer, s.ptr, s.device, s.slot, s.fds.at, s.order, s.desc) for s in sents)

    def __reduce__(self):
        return (_load_ahead, (self.ident, self.sends, bytes(self.payload)))


def _load_ahead(ident, sends, payload):
    from multiprocessing.reduction import ForkingPickler
    outer = getattr(_scope, "ahead", None)
    batch, failed = None, True
    try:
        batch = _scope.ahead = _Ahead.start(ident, sends)
        got = ForkingPickler.loads(payload)
        failed = False
        return got
    finally:
        _scope.ahead = outer
        if batch is not None:
            batch.end(failed)


class _Ahead:
    """A message's sends being opened on a thread of the library (`gpupool_share_open_ahead`)
    while this thread unpickles the message: each send's import is the one
    `Received.open_dlpack` would make, in the message's order; a rebuild takes it
    (`take_current`), and what none took is closed at the end, its hold released."""

    def __init__(self, handle, index, others):
        # The library's batch (None: nothing opened ahead), the index in it of each send it
        # opens, and the holds descriptor of each listed send it does not, by (producer, slot).
        self.handle, self.index, self.others = handle, index, others

    @staticmethod
    def start(ident, sends):
        t0 = time.perf_counter()
        try:
            return _Ahead._start(ident, sends)
        finally:
            ahead_counts["start_s"] += time.perf_counter() - t0

    @staticmethod
    def _start(ident, sends):
        """The batch for `sends` (`_ListedAhead`): those not open here already, each block
        once, opened on the library's thread, the rest kept to be let go should the message
        fail; or None where it cannot start (the rebuilds open their sends themselves then,
        and say what is wrong)."""
        try:
            if not ahead_enabled() or len(sends) < _AHEAD_FROM:
                return None
            _raise_fd_limit()
            with _lock:
                got = _received.get(ident)
                if got is None:
                    got = _received[ident] = _Received(ident)
            t0 = time.perf_counter()
            here = got.peek(None)
            ahead_counts["fetch_s"] += time.perf_counter() - t0
        except Exception:
            return None
        t0 = time.perf_counter()
        seen, index, others = set(), {}, {}
        descs, lens, devices, slots, fds, counts = [], [], [], [], [], []
        checks = tuple(opened_here_checks)
        try:
            for producer, ptr, device, slot, at, order, desc in sends:
                key = (producer, ptr, device)
                if key in seen or any(c(key) for c in checks):
                    # Let go by its rebuild (or opened there); let go here if the message fails first.
                    others[(producer, slot)] = here[at[0]]
                    continue
                seen.add(key)
                before = len(fds)
                fds.append(here[at[0]])
                fds += [here[i] for i in at[1:]] if order is None else [here[at[1 + j]] for j in order]
                counts.append(len(fds) - before)
                index[(producer, slot)] = len(slots)
                descs.append(desc)
                lens.append(len(desc))
                devices.append(device)
                slots.append(slot)
            n = len(slots)
            args = (n, b"".join(descs), (ctypes.c_size_t * n)(*lens), (ctypes.c_int * n)(*devices),
                    (ctypes.c_uint32 * n)(*slots), (ctypes.c_int * len(fds))(*fds), (ctypes.c_size_t * n)(*counts))
        except Exception:
            return None  # a list this receiver cannot read: the rebuilds open their sends
        finally:
            ahead_counts["list_s"] += time.perf_counter() - t0
        batch = _Ahead(None, {}, others)
        handle = ctypes.c_void_p()
        t0 = time.perf_counter()
        refused = n < _AHEAD_FROM or lib().gpupool_share_open_ahead(*args, ctypes.byref(handle)) != 0
        ahead_counts["open_s"] += time.perf_counter() - t0
        if refused:
            # Nothing to overlap, or no thread: the rebuilds open them, and the end lets go
            # of what none took. (Each send's entries start with its holds descriptor.)
            starts = [0]
            for c in counts:
                starts.append(starts[-1] + c)
            batch.others.update({k: fds[starts[i]] for k, i in index.items()})
            return batch
        batch.handle, batch.index = handle.value, index
        ahead_counts["batches"] += 1
        ahead_counts["listed"] += n
        return batch

    @staticmethod
    def take_current(sent):
        """`sent`'s import made ahead in the message being unpickled on this thread (a
        `DLManagedTensor*`, now the caller's), or None: open it (or let it go) as usual."""
        batch = getattr(_scope, "ahead", None)
        if batch is None:
            return None
        key = (sent.producer, sent.slot)
        batch.others.pop(key, None)  # its rebuild deals with it
        i = batch.index.pop(key, None)
        if i is None or batch.handle is None:
            return None
        out = ctypes.c_void_p()
        t0 = time.perf_counter()
        _check(lib().gpupool_share_take_ahead(batch.handle, i, ctypes.byref(out)))
        ahead_counts["take_s"] += time.perf_counter() - t0
        if out.value is not None:
            ahead_counts["taken"] += 1
        return out.value

    def end(self, failed):
        """Stop the thread and close what no rebuild took; where the message `failed`, let
        go of every listed send no rebuild took (nobody will open them)."""
        handle, self.handle = self.handle, None
        t0 = time.perf_counter()
        if handle is not None:
            lib().gpupool_share_end_ahead(handle, 1 if failed else 0)
        others, self.others = self.others, {}
        if failed:
            for (_, slot), holds_fd in others.items():
                lib().gpupool_share_release(holds_fd, slot)
        ahead_counts["end_s"] += time.perf_counter() - t0


_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def capsule(managed):
    """A "dltensor" capsule over `managed` (a `DLManagedTensor*`) for `from_dlpack`, which
    takes it over. If the framework refuses it, `delete_dlpack(managed)` undoes the import."""
    return _PyCapsule_New(managed, b"dltensor", None)


class _DLManaged(ctypes.Structure):
    # DLTensor (data, device, ndim, dtype, shape, strides, byte_offset), manager_ctx, deleter
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32),
                ("ndim", ctypes.c_int32), ("dtype", ctypes.c_uint8 * 4), ("shape", ctypes.c_void_p),
                ("strides", ctypes.c_void_p), ("byte_offset", ctypes.c_uint64), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.CFUNCTYPE(None, ctypes.c_void_p))]


def dlpack_data(managed):
    """The address an imported `DLManagedTensor*` shows the block at."""
    return _DLManaged.from_address(managed).data


def delete_dlpack(managed):
    """Run an imported tensor's deleter (one no framework took over)."""
    _DLManaged.from_address(managed).deleter(managed)


def open_cuda_ipc_handle(handle, offset, size, device):
    """Map `size` bytes at `offset` in the allocation behind `handle` (64 bytes of
    `cudaIpcGetMemHandle`, another process's) on `device`; returns a `DLManagedTensor*`
    (as `Received.open_dlpack`) whose deleter closes the mapping. Each allocation is mapped
    once in this process however many blocks of it are open (the library counts them)."""
    if len(handle) != 64:
        raise GpupoolError(6, f"gpupool: a CUDA IPC handle is 64 bytes, not {len(handle)}")
    # The library's segment descriptor (src/share/protocol/segment_descriptor.rs): magic, pid, device,
    # start time, handle, offset, size. The pid and start time only name the sender in
    # reports; nothing checks them for this kind.
    desc = b"GPPLEG01" + struct.pack("<IiQ", 0, device, 0) + bytes(handle) + struct.pack("<QQ", offset, size)
    out = ctypes.c_void_p()
    _check(lib().gpupool_ipc_open_dlpack(desc, len(desc), device, None, 0, -1, 0, ctypes.byref(out)))
    return out.value


def give_back_count(managed, name, byte_offset):
    """Make `managed` (an import not yet handed to a framework) give a sender's count back
    once its deleter has closed it: the 64-bit count at `byte_offset` in the shared-memory
    object `name` (bytes, as `shm_open` takes it) goes down by one, in the library (no
    Python runs in the deleter). PyTorch's own CUDA IPC route counts its sends so."""
    name = bytes(name)
    _check(lib().gpupool_dlpack_give_back_count(managed, name, len(name), byte_offset))


@atexit.register
def _at_exit():
    try:
        left = collect() if _sent else 0
    except GpupoolError:
        left = len(_sent)
    if left:
        sys.stderr.write(
            f"gpupool: warning: producer process is exiting while other processes still hold {left} block(s) it "
            "shared (torch.multiprocessing / gpupool.cupy.share). Arena memory stays valid for them (their mappings "
            "keep it); memory of the split pool goes with this process, as with PyTorch's own CUDA IPC "
            "(see PyTorch's Note [Sharing CUDA tensors]): keep the producer alive until consumers let go.\n")
