"""The process-sharing route the frameworks use (`gpupool.share`), on the host upstream
(runs everywhere, CI included): a producer sends arena blocks through a
`multiprocessing` queue (spawn) to a consumer, which maps them, reads and writes them; the
producer keeps each block until the consumer lets go, a block sent again is not mapped
twice, and a producer that exits first says so. `test_torch.py` runs the same through
`torch.multiprocessing` on a GPU."""
import os
import textwrap

from conftest import ok, run_py

CHILD = """
import ctypes, gpupool

def consume(inq, outq):
    gpupool.configure(0, pool="arena", upstream="host")
    held, opened = [], {}
    while True:
        msg = inq.get()
        if msg in ("release", "stop"):
            for m in held:
                gpupool.share.delete_dlpack(m)
            held.clear()
            opened.clear()
            outq.put("released")
            if msg == "stop":
                return
            continue
        out = []
        for s in msg:
            r = gpupool.share.Received(s)
            if (s.producer, s.ptr) in opened:
                r.let_go()
                out.append(("again", ctypes.string_at(opened[(s.producer, s.ptr)], 4)))
                continue
            m = r.open_dlpack(0)
            held.append(m)
            p = gpupool.share.dlpack_data(m)
            opened[(s.producer, s.ptr)] = p
            data = ctypes.string_at(p, s.size)
            ctypes.memmove(p, b"kid!", 4)
            out.append((p, data))
        outq.put(out)
"""


def _child_module(tmp_path):
    (tmp_path / "share_child.py").write_text(textwrap.dedent(CHILD))
    return {"PYTHONPATH_EXTRA": str(tmp_path)}


def test_blocks_go_through_a_queue_are_held_until_the_consumer_lets_go_on_host(library, tmp_path):
    out = ok(run_py("""
        import ctypes, gc, multiprocessing, os, sys, weakref, gpupool
        sys.path.insert(0, os.environ["PYTHONPATH_EXTRA"])
        import share_child
        gpupool.configure(0, pool="arena", upstream="host")
        L = gpupool.lib()
        # Small blocks share a granule (the route exports them anyway); a large one spans
        # two; a 64 MiB one lists 33 granules, whose descriptors travel once each (on the
        # host every granule is an offset of one file: one descriptor; a GPU's chunk, one).
        sizes = [256, 4096, (3 << 20) + 777, 9 << 20, 64 << 20]
        cycle = bytes(range(251)) * ((64 << 20) // 251 + 2)
        pat = lambda i, n: cycle[i * 7 % 251:i * 7 % 251 + n]  # byte j is (i * 7 + j) % 251
        ptrs = []
        for i, n in enumerate(sizes):
            p = ctypes.c_void_p()
            assert L.gpupool_malloc(ctypes.byref(p), n, 0, None) == 0
            ctypes.memmove(p, pat(i, n), n)
            ptrs.append(p.value)

        class Keep:
            pass
        keeps = [Keep() for _ in sizes]
        alive = [weakref.ref(k) for k in keeps]
        sents = [gpupool.share.export(p, n, 0, k) for p, n, k in zip(ptrs, sizes, keeps)]
        del keeps
        chunked = sents[-1]
        # Its descriptors go once each, with no per-granule list (the library spreads them).
        assert len(gpupool.ipc_descriptor_fds(chunked.desc)) == 33 and chunked.order is None, chunked.order
        assert len(chunked.fds.at) == 2, chunked.fds.at
        ctx = multiprocessing.get_context("spawn")
        inq, outq = ctx.Queue(), ctx.Queue()
        child = ctx.Process(target=share_child.consume, args=(inq, outq), daemon=True)
        child.start()
        inq.put(sents)
        got = outq.get(timeout=60)
        for i, ((where, data), n) in enumerate(zip(got, sizes)):
            assert data == pat(i, n), f"block {i}: the consumer read other bytes"
            assert ctypes.string_at(ptrs[i], 4) == b"kid!", f"block {i}: the consumer's write is not here"
            assert ctypes.string_at(ptrs[i] + 4, 4) == pat(i, 8)[4:]
        assert gpupool.share.collect() == 5 and all(a() is not None for a in alive), "kept while the consumer holds"
        # Sent again (another view of the same block): not mapped twice, released at once.
        inq.put([gpupool.share.export(ptrs[1], sizes[1], 0, Keep())])
        assert outq.get(timeout=60) == [("again", b"kid!")]
        assert gpupool.share.collect() == 5, "the second send was let go at once"
        inq.put("release")
        assert outq.get(timeout=60) == "released"
        assert gpupool.share.collect() == 0, "every hold released"
        gc.collect()
        assert all(a() is None for a in alive), "what was kept for the sends is dropped"
        inq.put("stop")
        assert outq.get(timeout=60) == "released"
        child.join(60)
        assert child.exitcode == 0, child.exitcode
        for p in ptrs:
            assert L.gpupool_free(ctypes.c_void_p(p), 0, None) == 0
        assert "0 live allocation" in gpupool.report_leaks() or gpupool.stats(0)["n_live_blocks"] == 0
        print("ok")
    """, env=_child_module(tmp_path), timeout=180))
    assert "ok" in out


def test_sends_from_a_sender_with_per_granule_lists_still_open_on_host(library, tmp_path):
    # Senders before this library listed, per granule, which of the block's descriptors it
    # is (`order`), and receivers passed one descriptor per granule: such sends open and
    # read as sent, alone (opened by their rebuild) and two in a message (opened ahead),
    # and are let go once released.
    out = ok(run_py("""
        import ctypes, multiprocessing, os, sys, gpupool
        sys.path.insert(0, os.environ["PYTHONPATH_EXTRA"])
        import share_child
        gpupool.configure(0, pool="arena", upstream="host")
        L = gpupool.lib()

        class Keep:
            pass

        def old_send(n, tag):
            p = ctypes.c_void_p()
            assert L.gpupool_malloc(ctypes.byref(p), n, 0, None) == 0
            ctypes.memmove(p, tag, 4)
            sent = gpupool.share.export(p.value, n, 0, Keep())
            per_granule = gpupool.ipc_descriptor_fds(sent.desc)
            uniq = list(dict.fromkeys(per_granule))
            old = sent._replace(order=[uniq.index(f) for f in per_granule])
            assert len(old.order) == len(per_granule) >= 5, old.order
            return p, old

        ctx = multiprocessing.get_context("spawn")
        inq, outq = ctx.Queue(), ctx.Queue()
        child = ctx.Process(target=share_child.consume, args=(inq, outq), daemon=True)
        child.start()
        blocks = []
        for message in ([b"old0"], [b"old1", b"old2"]):
            sends = []
            for tag in message:
                p, old = old_send((9 << 20) + 5, tag)
                blocks.append((p, tag))
                sends.append(old)
            inq.put(sends)
            got = outq.get(timeout=60)
            assert [data[:4] for _, data in got] == message, got
        assert all(ctypes.string_at(p, 4) == b"kid!" for p, _ in blocks), "the consumer's writes are here"
        inq.put("stop")
        assert outq.get(timeout=60) == "released"
        child.join(60)
        assert child.exitcode == 0, child.exitcode
        assert gpupool.share.collect() == 0, "let go once released"
        for p, _ in blocks:
            assert L.gpupool_free(p, 0, None) == 0
        print("ok")
    """, env=_child_module(tmp_path), timeout=180))
    assert "ok" in out


def test_a_producer_that_exits_while_a_consumer_holds_says_so_on_host(library, tmp_path):
    p = run_py("""
        import ctypes, multiprocessing, os, sys, gpupool
        sys.path.insert(0, os.environ["PYTHONPATH_EXTRA"])
        import share_child
        gpupool.configure(0, pool="arena", upstream="host")
        p = ctypes.c_void_p()
        assert gpupool.lib().gpupool_malloc(ctypes.byref(p), 1 << 20, 0, None) == 0
        ctypes.memmove(p, b"live", 4)
        ctx = multiprocessing.get_context("spawn")
        inq, outq = ctx.Queue(), ctx.Queue()
        # A daemon consumer: multiprocessing ends it at exit, still holding the block.
        child = ctx.Process(target=share_child.consume, args=(inq, outq), daemon=True)
        child.start()
        inq.put([gpupool.share.export(p.value, 1 << 20, 0, p)])
        assert outq.get(timeout=60)[0][1][:4] == b"live"
        print("producer leaves")
    """, env=_child_module(tmp_path), timeout=180)
    assert p.returncode == 0, p.stderr
    assert "producer leaves" in p.stdout
    assert "producer process is exiting while other processes still hold 1 block(s)" in p.stderr, p.stderr


def test_sending_refuses_what_is_not_a_gpupool_block_on_host(library):
    out = ok(run_py("""
        import ctypes, gpupool
        gpupool.configure(0, pool="arena", upstream="host")
        buf = ctypes.create_string_buffer(64)
        try:
            gpupool.share.export(ctypes.addressof(buf), 64, 0, None)
            raise SystemExit("exported memory gpupool never allocated")
        except gpupool.GpupoolError as e:
            assert e.status == 3 and "not a block gpupool allocated" in str(e), e
        assert gpupool.share.outstanding() == 0
        print("ok")
    """))
    assert "ok" in out


LAZY_CHILD = """
import ctypes, gpupool

class Lazy:
    # Exported while multiprocessing pickles the message (as the torch and CuPy routes do).
    def __init__(self, ptr, size):
        self.ptr, self.size = ptr, size

    def __reduce__(self):
        return (opened, (gpupool.share.export(self.ptr, self.size, 0, self),))

def opened(sent):
    r = gpupool.share.Received(sent)
    m = r.open_dlpack(0)
    data = ctypes.string_at(gpupool.share.dlpack_data(m), 4)
    gpupool.share.delete_dlpack(m)
    return data

def open_fds():
    # Files and sockets open here; the receiver keeps one connection per sender.
    import os
    kinds = []
    for f in os.listdir("/proc/self/fd"):
        try:
            kinds.append(os.readlink(f"/proc/self/fd/{f}").startswith("socket:"))
        except OSError:
            pass  # listdir's own descriptor, closed already
    return len(kinds) - sum(kinds), sum(kinds)

def consume(inq, outq):
    gpupool.configure(0, pool="arena", upstream="host")
    gpupool.share.route_multiprocessing()  # as gpupool.torch.install() does: its own thread starts here
    files, sockets = open_fds()
    outq.put(inq.get())
    outq.put(len(gpupool.share._received))
    now = open_fds()
    outq.put((now[0] - files, now[1] - sockets))
"""


def test_the_sends_of_one_message_travel_in_one_handover_on_host(library, tmp_path):
    (tmp_path / "lazy_child.py").write_text(textwrap.dedent(LAZY_CHILD))
    out = ok(run_py("""
        import ctypes, multiprocessing, os, sys, gpupool
        from multiprocessing import resource_sharer
        sys.path.insert(0, os.environ["PYTHONPATH_EXTRA"])
        import lazy_child
        gpupool.configure(0, pool="arena", upstream="host")
        gpupool.share.route_multiprocessing()
        gpupool.share.route_multiprocessing()  # idempotent
        L = gpupool.lib()
        ptrs = []
        for i in range(5):
            p = ctypes.c_void_p()
            assert L.gpupool_malloc(ctypes.byref(p), (i + 1) << 20, 0, None) == 0
            ctypes.memmove(p, b"blk" + bytes([48 + i]), 4)
            ptrs.append(p.value)
        ctx = multiprocessing.get_context("spawn")
        inq, outq = ctx.Queue(), ctx.Queue()
        child = ctx.Process(target=lazy_child.consume, args=(inq, outq), daemon=True)
        child.start()
        registered = len(resource_sharer._resource_sharer._cache)
        tickets, bundles = [], []
        new_ticket = gpupool.share._new_ticket
        gpupool.share._new_ticket = lambda: tickets.append(new_ticket()) or tickets[-1]
        add = gpupool.share._Bundle.add

        def spy(b, fds, hold=None):
            at = add(b, fds, hold)
            bundles.append((id(b), len(b.at), b.sends))
            return at
        gpupool.share._Bundle.add = spy
        inq.put([lazy_child.Lazy(p, (i + 1) << 20) for i, p in enumerate(ptrs)])
        assert outq.get(timeout=60) == [b"blk" + bytes([48 + i]) for i in range(5)]
        assert outq.get(timeout=60) == 0, "every descriptor received was taken"
        assert outq.get(timeout=60) == (0, 1), "the child closed every descriptor it received (and kept one connection)"
        assert len(tickets) == 1 and isinstance(tickets[0], bytes), f"{tickets}: one handover for one message, the library's"
        # Each descriptor once: the holds file and (on the host) the one file under every
        # granule, for five sends.
        assert len({b[0] for b in bundles}) == 1 and bundles[-1][1:] == (2, 5), bundles
        # One handover for the five sends, taken by the child: not there any more.
        try:
            gpupool.share._fetch(tickets[0])
            raise AssertionError("taken twice")
        except gpupool.GpupoolError as e:
            assert "taken once" in str(e), e
        assert len(resource_sharer._resource_sharer._cache) == registered, "the resource sharer was not used"
        assert gpupool.share.collect() == 0, "the child let go of all five"
        child.join(60)
        print("ok")
    """, env={"PYTHONPATH_EXTRA": str(tmp_path)}, timeout=180))
    assert "ok" in out


BOOM_CHILD = LAZY_CHILD + """
def boom():
    raise ValueError("boom")

class Boom:
    def __reduce__(self):
        return (boom, ())

def _same(x):
    return x

class LazyRaw:
    # Exported while pickled, received as a send nobody opens.
    def __init__(self, ptr, size):
        self.ptr, self.size = ptr, size

    def __reduce__(self):
        return (_same, (gpupool.share.export(self.ptr, self.size, 0, self),))

def unpickle_inner(b):
    from multiprocessing.reduction import ForkingPickler
    return ForkingPickler.loads(b)

class Inner:
    # A message pickled inside the message (its own handover).
    def __init__(self, items):
        self.items = items

    def __reduce__(self):
        from multiprocessing.reduction import ForkingPickler
        return (unpickle_inner, (bytes(ForkingPickler.dumps(self.items)),))

def consume_failing(inq, outq):
    import os
    gpupool.configure(0, pool="arena", upstream="host")
    gpupool.share.route_multiprocessing()  # as gpupool.torch.install() does in every process
    before = open_fds()
    try:
        inq.get()
        outq.put("unpickled")
    except ValueError as e:
        outq.put(str(e))
    now = open_fds()
    # No file left open; at most the one kept connection to the sender.
    outq.put((len(gpupool.share._received), now[0] - before[0] + max(0, now[1] - before[1] - 1)))
"""


def _boom(tmp_path, message, why):
    """Send `message` (an expression over `boom_child` and `ptrs`, two 1 MiB blocks) to a
    consumer whose unpickling of it fails with "boom"; the consumer must end with no
    handover kept and no descriptor open."""
    (tmp_path / "boom_child.py").write_text(textwrap.dedent(BOOM_CHILD))
    out = ok(run_py(f"""
        import ctypes, multiprocessing, os, sys, gpupool
        sys.path.insert(0, os.environ["PYTHONPATH_EXTRA"])
        import boom_child
        gpupool.configure(0, pool="arena", upstream="host")
        gpupool.share.route_multiprocessing()
        L = gpupool.lib()
        ptrs = []
        for i in range(2):
            p = ctypes.c_void_p()
            assert L.gpupool_malloc(ctypes.byref(p), 1 << 20, 0, None) == 0
            ptrs.append(p.value)
        ctx = multiprocessing.get_context("spawn")
        inq, outq = ctx.Queue(), ctx.Queue()
        child = ctx.Process(target=boom_child.consume_failing, args=(inq, outq), daemon=True)
        child.start()
        inq.put({message})
        assert outq.get(timeout=60) == "boom"
        assert outq.get(timeout=60) == (0, 0), {why!r}
        child.join(60)
        print("ok")
    """, env={"PYTHONPATH_EXTRA": str(tmp_path)}, timeout=180))
    assert "ok" in out


def test_a_message_that_fails_to_unpickle_leaves_no_descriptor_open_on_host(library, tmp_path):
    # Three things in one message: a send taken, an object whose rebuild raises, a send
    # never taken. The handover's descriptors are closed all the same.
    _boom(tmp_path, "[boom_child.Lazy(ptrs[0], 1 << 20), boom_child.Boom(), boom_child.Lazy(ptrs[1], 1 << 20)]",
          "the child kept the handover or its descriptors")


def test_a_message_inside_a_message_that_fails_to_unpickle_leaves_no_descriptor_open_on_host(library, tmp_path):
    # The inner message unpickles (one send opened, one not), then the outer one fails:
    # the inner handover, with a send never taken, is closed with the outer message.
    _boom(tmp_path, "[boom_child.Inner([boom_child.Lazy(ptrs[0], 1 << 20), boom_child.LazyRaw(ptrs[1], 1 << 20)]), "
                    "boom_child.Boom()]",
          "the child kept the inner handover or its descriptors")


AHEAD_CHILD = BOOM_CHILD + """
def consume_later(inq, outq):
    # Sends received unopened (`LazyRaw`), opened only after the message, as a route that
    # keeps its sends may: they must still be held, and read as sent.
    gpupool.configure(0, pool="arena", upstream="host")
    gpupool.share.route_multiprocessing()
    sents = inq.get()
    outq.put("received")
    assert inq.get() == "open"
    got = []
    for s in sents:
        m = gpupool.share.Received(s).open_dlpack(0)
        got.append(ctypes.string_at(gpupool.share.dlpack_data(m), 4))
        gpupool.share.delete_dlpack(m)
    outq.put(got)

def consume_known(inq, outq):
    # The first message's block stays open here; a later send of it is let go by its
    # rebuild, and the route says it is open (as the torch and CuPy routes do), so it is
    # not opened ahead.
    gpupool.configure(0, pool="arena", upstream="host")
    gpupool.share.route_multiprocessing()
    mine = {}
    gpupool.share.opened_here_checks.append(mine.__contains__)
    first = inq.get()[0]
    mine[(first.producer, first.ptr, first.device)] = gpupool.share.Received(first).open_dlpack(0)
    outq.put("kept")
    for s in inq.get():
        r = gpupool.share.Received(s)
        if (s.producer, s.ptr, s.device) in mine:
            r.let_go()
        else:
            gpupool.share.delete_dlpack(r.open_dlpack(0))
    outq.put(gpupool.share.ahead_counts["listed"])
    assert inq.get() == "stop"
    for m in mine.values():
        gpupool.share.delete_dlpack(m)
    outq.put("stopped")

class OldLazy:
    # As Lazy, sent as a sender before this library sent it: with, per granule, which of
    # the block's descriptors it is (`order`).
    def __init__(self, ptr, size):
        self.ptr, self.size = ptr, size

    def __reduce__(self):
        sent = gpupool.share.export(self.ptr, self.size, 0, self)
        per_granule = gpupool.ipc_descriptor_fds(sent.desc)
        uniq = list(dict.fromkeys(per_granule))
        return (opened, (sent._replace(order=[uniq.index(f) for f in per_granule]),))

def consume_costs(inq, outq):
    # What opening ahead cost, as the route and the library count it.
    gpupool.configure(0, pool="arena", upstream="host")
    gpupool.share.route_multiprocessing()
    got = inq.get()
    outq.put((got, dict(gpupool.share.ahead_counts), gpupool.share.ahead_costs()))

def consume_ahead(inq, outq):
    gpupool.configure(0, pool="arena", upstream="host")
    gpupool.share.route_multiprocessing()
    before = open_fds()
    try:
        outq.put(inq.get())
    except ValueError as e:
        outq.put(str(e))
    now = open_fds()
    counts = {k: gpupool.share.ahead_counts[k] for k in ("batches", "listed", "taken")}
    outq.put((counts, gpupool.stats_json(0).get("ipc_imports"), len(gpupool.share._received),
              now[0] - before[0] + max(0, now[1] - before[1] - 1)))
"""


def _ahead_producer(tmp_path, sizes):
    """A producer's script so far: `ahead_child` importable, blocks of `sizes` at `ptrs`
    whose first four bytes say which, and a spawn context's queues `inq` and `outq`."""
    (tmp_path / "ahead_child.py").write_text(textwrap.dedent(AHEAD_CHILD))
    return textwrap.dedent(f"""
        import ctypes, multiprocessing, os, sys, gpupool
        sys.path.insert(0, os.environ["PYTHONPATH_EXTRA"])
        import ahead_child
        gpupool.configure(0, pool="arena", upstream="host")
        gpupool.share.route_multiprocessing()
        L = gpupool.lib()
        ptrs = []
        for i, n in enumerate({sizes!r}):
            p = ctypes.c_void_p()
            assert L.gpupool_malloc(ctypes.byref(p), n, 0, None) == 0
            ctypes.memmove(p, b"blk" + bytes([48 + i]), 4)
            ptrs.append(p.value)
        ctx = multiprocessing.get_context("spawn")
        inq, outq = ctx.Queue(), ctx.Queue()
    """)


def _ahead(tmp_path, message, env=None):
    """Send `message` (an expression over `ahead_child` and `ptrs`, six blocks) to a
    consumer; returns what it unpickled (or the error's text), then its opening-ahead
    counts and imports, handovers and descriptors left open, and the sends the producer
    still finds held."""
    # Small blocks in one granule, one of several granules, one that starts in the
    # granule another ends in.
    head = _ahead_producer(tmp_path, [256, 4096, 3 << 20, 1 << 20, 5 << 20, 512])
    out = ok(run_py(head + textwrap.dedent(f"""
        child = ctx.Process(target=ahead_child.consume_ahead, args=(inq, outq), daemon=True)
        child.start()
        inq.put({message})
        got, after = outq.get(timeout=60), outq.get(timeout=60)
        child.join(60)
        assert child.exitcode == 0, child.exitcode
        print(repr((got, after, gpupool.share.collect())))
    """), env={"PYTHONPATH_EXTRA": str(tmp_path), **(env or {})}, timeout=180))
    return eval(out.strip().splitlines()[-1])


def test_a_messages_sends_are_opened_ahead_while_it_is_unpickled_on_host(library, tmp_path):
    # Six blocks and the first again (a second view of it): each read as sent, each block
    # opened once ahead (the repeat is opened by its rebuild), every import taken by its
    # rebuild, closed, its hold released; nothing left open.
    got, (counts, imports, handovers, fds), held = _ahead(
        tmp_path, "[ahead_child.Lazy(p, 4) for p in ptrs] + [ahead_child.Lazy(ptrs[0], 4)]")
    assert got == [b"blk" + bytes([48 + i]) for i in range(6)] + [b"blk0"], got
    assert counts == {"batches": 1, "listed": 6, "taken": 6}, counts
    assert (imports, handovers, fds, held) == (0, 0, 0, 0), (imports, handovers, fds, held)


def test_sends_with_per_granule_lists_are_opened_ahead_on_host(library, tmp_path):
    # A sender before this library's listed its sends' granules (`order`): they are
    # opened ahead all the same, each read as sent, nothing left open.
    got, (counts, imports, handovers, fds), held = _ahead(tmp_path, "[ahead_child.OldLazy(p, 4) for p in ptrs]")
    assert got == [b"blk" + bytes([48 + i]) for i in range(6)], got
    assert counts == {"batches": 1, "listed": 6, "taken": 6}, counts
    assert (imports, handovers, fds, held) == (0, 0, 0, 0), (imports, handovers, fds, held)


def test_what_opening_ahead_costs_is_counted_on_host(library, tmp_path):
    # The route's split of starting a batch (fetching, listing, the library's call) and the
    # library's own figures (batches, the thread's start, its opening, the rebuilds' waits)
    # move with a message opened ahead; on the host no arena import of a GPU is made.
    head = _ahead_producer(tmp_path, [1 << 20, 2 << 20, 3 << 20])
    out = ok(run_py(head + textwrap.dedent("""
        child = ctx.Process(target=ahead_child.consume_costs, args=(inq, outq), daemon=True)
        child.start()
        inq.put([ahead_child.Lazy(p, 4) for p in ptrs])
        print(repr(outq.get(timeout=60)))
        child.join(60)
    """), env={"PYTHONPATH_EXTRA": str(tmp_path)}, timeout=180))
    got, counts, costs = eval(out.strip().splitlines()[-1])
    assert got == [b"blk0", b"blk1", b"blk2"], got
    assert counts["batches"] == 1 and counts["taken"] == 3, counts
    assert counts["start_s"] >= counts["fetch_s"] + counts["list_s"] + counts["open_s"] > 0, counts
    assert costs["batches"] == 1, costs
    assert costs["opening_s"] > 0 and costs["thread_start_s"] > 0, costs
    # The library's waits are inside the route's takes.
    assert 0 <= costs["take_wait_s"] <= counts["take_s"], (costs, counts)
    assert costs["imports"]["count"] == 0 and set(costs["imports"]) == {
        "count", "reserve_s", "import_s", "map_s", "release_s", "grant_s"}, costs


def _ahead_script(tmp_path, body):
    head = _ahead_producer(tmp_path, [1 << 20, 2 << 20, 3 << 20])
    out = ok(run_py(head + textwrap.dedent(body) + 'print("ok")\n', env={"PYTHONPATH_EXTRA": str(tmp_path)}, timeout=180))
    assert "ok" in out


def test_sends_a_message_carries_unopened_stay_held_for_a_later_open_on_host(library, tmp_path):
    # Listed ahead but not opened while the message unpickled: the end of the message
    # closes what the thread opened and keeps the sends held; opened later, they read as
    # sent, and only then are let go.
    _ahead_script(tmp_path, """
        child = ctx.Process(target=ahead_child.consume_later, args=(inq, outq), daemon=True)
        child.start()
        inq.put([ahead_child.LazyRaw(p, 4) for p in ptrs])
        assert outq.get(timeout=60) == "received"
        assert gpupool.share.collect() == 3, "held while the consumer keeps the sends"
        inq.put("open")
        assert outq.get(timeout=60) == [b"blk0", b"blk1", b"blk2"]
        child.join(60)
        assert child.exitcode == 0
        assert gpupool.share.collect() == 0, "let go once opened and closed"
    """)


def test_a_block_open_here_already_is_not_opened_ahead_and_its_send_is_let_go_on_host(library, tmp_path):
    _ahead_script(tmp_path, """
        child = ctx.Process(target=ahead_child.consume_known, args=(inq, outq), daemon=True)
        child.start()
        inq.put([ahead_child.LazyRaw(ptrs[0], 4)])
        assert outq.get(timeout=60) == "kept"
        inq.put([ahead_child.LazyRaw(ptrs[0], 4), ahead_child.LazyRaw(ptrs[1], 4), ahead_child.LazyRaw(ptrs[2], 4)])
        assert outq.get(timeout=60) == 2, "the block open here was not listed to the thread"
        assert gpupool.share.collect() == 1, "only the first send is held: the second was let go at once"
        inq.put("stop")
        assert outq.get(timeout=60) == "stopped"
        child.join(60)
        assert gpupool.share.collect() == 0
    """)


def test_sends_are_not_opened_ahead_where_turned_off_on_host(library, tmp_path):
    got, (counts, imports, handovers, fds), held = _ahead(
        tmp_path, "[ahead_child.Lazy(p, 4) for p in ptrs]", env={"GPUPOOL_SHARE_AHEAD": "0"})
    assert got == [b"blk" + bytes([48 + i]) for i in range(6)], got
    assert counts == {"batches": 0, "listed": 0, "taken": 0}, counts
    assert (imports, handovers, fds, held) == (0, 0, 0, 0), (imports, handovers, fds, held)


def test_a_malformed_share_ahead_setting_is_refused_saying_so(library):
    out = ok(run_py("""
        import gpupool
        try:
            gpupool.share.route_multiprocessing()
            raise SystemExit("routed")
        except gpupool.GpupoolError as e:
            assert "GPUPOOL_SHARE_AHEAD='maybe'" in str(e), e
        print("ok")
    """, env={"GPUPOOL_SHARE_AHEAD": "maybe"}))
    assert "ok" in out


def test_sends_opened_ahead_of_a_message_that_fails_to_unpickle_are_closed_and_let_go_on_host(library, tmp_path):
    # Two sends taken, then a rebuild that raises, then four sends listed that no rebuild
    # takes and a second send of the first block (listed, not opened ahead): whether or not
    # the thread opened them, they are closed and let go with the message (nobody will
    # open them).
    got, (counts, imports, handovers, fds), held = _ahead(
        tmp_path, "[ahead_child.Lazy(p, 4) for p in ptrs[:2]] + [ahead_child.Boom()] + "
                  "[ahead_child.Lazy(p, 4) for p in ptrs[2:]] + [ahead_child.Lazy(ptrs[0], 4)]")
    assert got == "boom", got
    assert counts["batches"] == 1 and counts["listed"] == 6 and counts["taken"] == 2, counts
    assert (imports, handovers, fds, held) == (0, 0, 0, 0), (imports, handovers, fds, held)


def test_a_message_that_fails_to_pickle_releases_its_sends_holds_on_host(library, tmp_path):
    (tmp_path / "lazy_child.py").write_text(textwrap.dedent(LAZY_CHILD))
    out = ok(run_py("""
        import ctypes, os, sys, gpupool
        from multiprocessing.reduction import ForkingPickler
        sys.path.insert(0, os.environ["PYTHONPATH_EXTRA"])
        import lazy_child
        gpupool.configure(0, pool="arena", upstream="host")
        gpupool.share.route_multiprocessing()
        L = gpupool.lib()
        p = ctypes.c_void_p()
        assert L.gpupool_malloc(ctypes.byref(p), 1 << 20, 0, None) == 0

        class Unpicklable:
            def __reduce__(self):
                raise TypeError("not picklable")
        try:
            ForkingPickler.dumps([lazy_child.Lazy(p.value, 1 << 20), Unpicklable()])
            raise SystemExit("pickled")
        except TypeError:
            pass
        assert gpupool.share.outstanding() == 0 and gpupool.share.collect() == 0, "the unsent send still holds"

        # The same where what the message's end runs fails (its event's record, say).
        class FailsAtTheEnd:
            def __reduce__(self):
                def fail():
                    raise RuntimeError("the record failed")
                assert gpupool.share.at_message_end(fail)
                return (int, (0,))
        try:
            ForkingPickler.dumps([lazy_child.Lazy(p.value, 1 << 20), FailsAtTheEnd()])
            raise SystemExit("pickled")
        except RuntimeError:
            pass
        assert gpupool.share.outstanding() == 0 and gpupool.share.collect() == 0, "the unsent send still holds"
        assert L.gpupool_free(p, 0, None) == 0
        print("ok")
    """, env={"PYTHONPATH_EXTRA": str(tmp_path)}, timeout=120))
    assert "ok" in out


def test_a_block_from_a_process_that_is_gone_is_refused_saying_so_on_host(library, tmp_path):
    sent = tmp_path / "sent.pickle"
    ok(run_py(f"""
        import ctypes, gpupool
        from multiprocessing.reduction import ForkingPickler
        gpupool.configure(0, pool="arena", upstream="host")
        p = ctypes.c_void_p()
        assert gpupool.lib().gpupool_malloc(ctypes.byref(p), 4096, 0, None) == 0
        s = gpupool.share.export(p.value, 4096, 0, p)
        open({str(sent)!r}, "wb").write(bytes(ForkingPickler.dumps(s)))
    """))
    out = ok(run_py(f"""
        import pickle, gpupool
        gpupool.configure(0, pool="arena", upstream="host")
        s = pickle.loads(open({str(sent)!r}, "rb").read())
        try:
            gpupool.share.Received(s)
            raise SystemExit("received from a process that is gone")
        except gpupool.GpupoolError as e:
            assert f"(pid {{s.pid}}) is gone" in str(e), e
        print("ok")
    """))
    assert "ok" in out


def test_a_fork_child_keeps_nothing_of_a_sender_that_is_gone_on_host(library, tmp_path):
    # A sender forks a child that outlives it. Were the child to keep its copy of the
    # sender's socket (or its takers' connections), a take would wait for an answer nobody
    # gives instead of being told the sender is gone.
    ticket, child = tmp_path / "ticket", tmp_path / "child"
    ok(run_py(f"""
        import ctypes, os, time, gpupool
        gpupool.configure(0, pool="arena", upstream="host")
        t = gpupool.share._new_ticket()
        assert isinstance(t, bytes), t
        fd = os.open("/dev/null", os.O_RDONLY)
        assert gpupool.lib().gpupool_handover_add(t, len(t), (ctypes.c_int * 1)(fd), 1, 1) == 0
        open({str(ticket)!r}, "wb").write(t)
        pid = os.fork()
        if pid == 0:
            null = os.open("/dev/null", os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
            time.sleep(30)
            os._exit(0)
        open({str(child)!r}, "w").write(str(pid))
    """))  # the sender exits here; its child lives on
    pid = int(child.read_text())
    try:
        out = ok(run_py(f"""
            import time, gpupool
            gpupool.configure(0, pool="arena", upstream="host")
            t0 = time.monotonic()
            try:
                gpupool.share._fetch(open({str(ticket)!r}, "rb").read())
                raise SystemExit("a handover of a sender that is gone")
            except gpupool.GpupoolError as e:
                assert "is gone" in str(e), e
            print("ok", round(time.monotonic() - t0, 1))
        """, timeout=60))
        assert out.startswith("ok"), out
        assert float(out.split()[1]) < 10, out
    finally:
        os.kill(pid, 9)


def test_the_resource_sharer_carries_a_handover_where_the_library_cannot_on_host(library, tmp_path):
    # Where the library's descriptor thread cannot start (`_new_ticket` gives None), the
    # message's descriptors go through multiprocessing's resource sharer, still once each.
    (tmp_path / "lazy_child.py").write_text(textwrap.dedent(LAZY_CHILD))
    out = ok(run_py("""
        import ctypes, multiprocessing, os, sys, gpupool
        from multiprocessing import resource_sharer
        sys.path.insert(0, os.environ["PYTHONPATH_EXTRA"])
        import lazy_child
        gpupool.configure(0, pool="arena", upstream="host")
        gpupool.share.route_multiprocessing()
        gpupool.share._new_ticket = lambda: None
        L = gpupool.lib()
        ptrs = []
        for i in range(3):
            p = ctypes.c_void_p()
            assert L.gpupool_malloc(ctypes.byref(p), (i + 1) << 20, 0, None) == 0
            ctypes.memmove(p, b"old" + bytes([48 + i]), 4)
            ptrs.append(p.value)
        ctx = multiprocessing.get_context("spawn")
        inq, outq = ctx.Queue(), ctx.Queue()
        child = ctx.Process(target=lazy_child.consume, args=(inq, outq), daemon=True)
        child.start()
        registered = []
        register = resource_sharer._resource_sharer.register
        resource_sharer._resource_sharer.register = lambda *a: registered.append(register(*a)) or registered[-1]
        inq.put([lazy_child.Lazy(p, (i + 1) << 20) for i, p in enumerate(ptrs)])
        assert outq.get(timeout=60) == [b"old" + bytes([48 + i]) for i in range(3)]
        assert outq.get(timeout=60) == 0, "every descriptor received was taken"
        assert outq.get(timeout=60)[0] == 0, "the child closed every descriptor it received"
        assert len(registered) == 1 and isinstance(registered[0], tuple), registered
        assert registered[0][1] not in resource_sharer._resource_sharer._cache, "taken by the child"
        assert gpupool.share.collect() == 0, "the child let go of all three"
        child.join(60)
        print("ok")
    """, env={"PYTHONPATH_EXTRA": str(tmp_path)}, timeout=180))
    assert "ok" in out


def test_work_deferred_to_a_message_end_runs_once_after_every_reduction_and_before_the_bytes_leave(library):
    # gpupool.torch records a message's event here, so that the record follows every kernel
    # the message's reducers queued: it must run after the last reduction, before dumps
    # returns, once per message (an inner message its own), never for a failed message nor
    # outside one.
    out = ok(run_py("""
        import pickle
        from multiprocessing.reduction import ForkingPickler
        import gpupool.share as S
        S.route_multiprocessing()
        log = []

        def _same(x):
            return x

        class Part:
            def __init__(self, name, fail=False, inner=False):
                self.name, self.fail, self.inner = name, fail, inner

            def __reduce__(self):
                log.append(("reduce", self.name))
                assert S.at_message_end(lambda: log.append(("end", self.name)))
                if self.inner:  # a reducer pickling a message of its own
                    ForkingPickler.dumps(Part(self.name + "/inner"))
                if self.fail:
                    raise ValueError("no")
                return (_same, (self.name,))

        assert not S.at_message_end(lambda: log.append("outside")), "no message is being pickled"
        data = ForkingPickler.dumps([Part("a"), Part("b", inner=True), Part("c")])
        assert log == [("reduce", "a"), ("reduce", "b"), ("reduce", "b/inner"), ("end", "b/inner"),
                       ("reduce", "c"), ("end", "a"), ("end", "b"), ("end", "c")], log
        log.clear()

        class Loaded:
            def __reduce__(self):
                return (_check_loading, ())
        import builtins
        def _check_loading():
            builtins.deferred = S.at_message_end(lambda: log.append("while loading"))
            return "loaded"
        import __main__
        __main__._check_loading = _check_loading
        assert ForkingPickler.loads(ForkingPickler.dumps(Loaded())) == "loaded"
        assert builtins.deferred is False and log == [], "nothing is deferred while a message is unpickled"
        try:
            ForkingPickler.dumps([Part("x"), Part("y", fail=True)])
            raise AssertionError("pickled")
        except ValueError:
            pass
        assert log == [("reduce", "x"), ("reduce", "y")], log
        assert pickle.loads(data) == ["a", "b", "c"]
        print("ok")
    """))
    assert "ok" in out


STAND_IN_TORCH = """
# Just enough of torch for gpupool.torch's send events: a log of records and kernels.
log = []


class Event:
    made = 0

    def __init__(self, **kwargs):
        Event.made += 1
        self.id = Event.made

    def record(self, stream):
        log.append(("record", self.id, stream.cuda_stream))

    def ipc_handle(self):
        return b"event%d" % self.id


class _Stream:
    def __init__(self, raw):
        self.cuda_stream = raw


class cuda:
    Event = Event
    stream = 7

    @staticmethod
    def current_stream(device):
        return _Stream(cuda.stream)
"""


def test_a_messages_event_is_recorded_at_its_first_send_and_once_its_last_reduction_is_done(library, tmp_path):
    # gpupool.torch's event logic with a stand-in torch (the GPU test of the same, with
    # real kernels, is test_torch.py's ordered-sends test): one event per message and
    # stream, recorded at its first send and after the message's last reduction (so after
    # a kernel a reducer queues between two sends); a send outside a message, or made
    # while a message is unpickled, records an event of its own.
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(STAND_IN_TORCH)
    out = ok(run_py("""
        import os, sys
        sys.path.insert(0, os.environ["PYTHONPATH_EXTRA"])
        import torch
        assert torch.__file__.startswith(os.environ["PYTHONPATH_EXTRA"]), torch.__file__
        from multiprocessing.reduction import ForkingPickler
        import gpupool.share as S, gpupool.torch as GT
        S.route_multiprocessing()
        log = torch.log

        class Send:
            def __reduce__(self):
                event, handle = GT._send_event(0)
                log.append(("send", handle))
                return (int, (1,))

        class Kernel:
            def __reduce__(self):
                log.append("kernel")
                return (int, (2,))

        class OnStream:
            def __init__(self, raw):
                self.raw = raw

            def __reduce__(self):
                torch.cuda.stream = self.raw
                return (int, (3,))

        ForkingPickler.dumps([Send(), Kernel(), Send(), Kernel(), OnStream(9), Send(), OnStream(7)])
        assert log == [("record", 1, 7), ("send", b"event1"), "kernel", ("send", b"event1"), "kernel",
                       ("record", 2, 9), ("send", b"event2"), ("record", 1, 7), ("record", 2, 9)], log
        log.clear()
        GT._send_event(0), GT._send_event(0)
        assert log == [("record", 3, 7), ("record", 4, 7)], log
        log.clear()

        def rebuild():
            GT._send_event(0)
            log.append("kernel")
            GT._send_event(0)
            return 0
        import __main__
        __main__.rebuild = rebuild

        class Later:
            def __reduce__(self):
                return (rebuild, ())
        data = ForkingPickler.dumps(Later())
        log.clear()
        ForkingPickler.loads(data)
        assert log == [("record", 5, 7), "kernel", ("record", 6, 7)], log
        print("ok")
    """, env={"PYTHONPATH_EXTRA": str(tmp_path)}))
    assert "ok" in out


COUNT_CHILD = """
import gpupool

def consume(inq, outq):
    gpupool.configure(0, pool="arena", upstream="host")
    s, name, offset = inq.get()
    managed = gpupool.share.Received(s).open_dlpack(0)
    refused = []
    for bad in ((b"", offset), (name + b"\\0", offset), (name, offset + 4)):
        try:
            gpupool.share.give_back_count(managed, *bad)
        except gpupool.GpupoolError as e:
            refused.append(str(e))
    gpupool.share.give_back_count(managed, name, offset)
    before = gpupool.stats_json(0).get("ipc_imports")
    outq.put(("mapped", before, refused))
    assert inq.get() == "let go"
    gpupool.share.delete_dlpack(managed)  # what the framework does when its last tensor goes
    outq.put(gpupool.stats_json(0).get("ipc_imports"))
"""


def test_a_senders_count_goes_back_once_the_import_is_closed_on_host(library, tmp_path):
    # gpupool.torch gives PyTorch's count of a send back this way (tensors from a process
    # without gpupool): in the library's deleter, after the close, by one, in the
    # shared-memory object and slot named; bad names and offsets are refused.
    (tmp_path / "count_child.py").write_text(textwrap.dedent(COUNT_CHILD))
    out = ok(run_py("""
        import ctypes, multiprocessing, os, struct, sys, gpupool
        from multiprocessing import shared_memory
        sys.path.insert(0, os.environ["PYTHONPATH_EXTRA"])
        import count_child
        gpupool.configure(0, pool="arena", upstream="host")
        L = gpupool.lib()
        ptr = ctypes.c_void_p()
        assert L.gpupool_malloc(ctypes.byref(ptr), 4 << 20, 0, None) == 0
        counts = shared_memory.SharedMemory(create=True, size=64 + 8 * 16)
        try:
            struct.pack_into("<qqq", counts.buf, 64 + 8 * 2, 7, 2, 7)  # slots 2, 3, 4
            ctx = multiprocessing.get_context("spawn")
            inq, outq = ctx.Queue(), ctx.Queue()
            child = ctx.Process(target=count_child.consume, args=(inq, outq), daemon=True)
            child.start()
            inq.put((gpupool.share.export(ptr.value, 4 << 20, 0, ptr), ("/" + counts.name).encode(), 64 + 8 * 3))
            kind, before, refused = outq.get(timeout=60)
            assert before == 1 and len(refused) == 3 and all("shared count" in r for r in refused), (before, refused)
            assert struct.unpack_from("<qqq", counts.buf, 64 + 8 * 2) == (7, 2, 7), "not before the import closes"
            inq.put("let go")
            assert outq.get(timeout=60) == 0, "closed"
            assert struct.unpack_from("<qqq", counts.buf, 64 + 8 * 2) == (7, 1, 7), "given back once, in its slot"
            child.join(60)
            assert child.exitcode == 0
        finally:
            counts.close()
            counts.unlink()
        print("ok")
    """, env={"PYTHONPATH_EXTRA": str(tmp_path)}, timeout=120))
    assert "ok" in out


def test_a_cuda_ipc_handle_is_refused_saying_why_where_it_cannot_be_opened_on_host(library):
    out = ok(run_py("""
        import gpupool
        gpupool.configure(0, pool="arena", upstream="host")
        for handle, says in ((b"x" * 63, "64 bytes, not 63"), (b"x" * 64, "cannot map CUDA IPC handles")):
            try:
                gpupool.share.open_cuda_ipc_handle(handle, 0, 4096, 0)
                raise AssertionError("opened")
            except gpupool.GpupoolError as e:
                assert says in str(e), e
        assert gpupool.stats_json(0).get("ipc_imports") == 0
        print("ok")
    """))
    assert "ok" in out


def test_exports_racing_a_collect_never_drop_a_block_a_consumer_holds_on_host(library):
    # 8 threads export (as multiprocessing's feeder threads pickle) while another thread
    # collects: a slot the library gives back as released must not be taken by an export
    # and then have that export's storage forgotten. A stand-in consumer releases each
    # send's hold; a storage dropped before its send was released is the bug. 30,000 sends
    # here (SHARE_RACE_SENDS sets another count; the fault showed within 20,000).
    out = ok(run_py("""
        import ctypes, os, queue, threading, gpupool
        gpupool.configure(0, pool="arena", upstream="host")
        L = gpupool.lib()
        SENDS, THREADS = int(os.environ.get("SHARE_RACE_SENDS", 30_000)), 8
        released = bytearray(SENDS)
        bad, errors = [], []

        class Keep:
            __slots__ = ("i",)
            def __init__(self, i):
                self.i = i
            def __del__(self):
                if not released[self.i]:
                    bad.append(self.i)

        blocks = []
        for _ in range(THREADS):
            p = ctypes.c_void_p()
            assert L.gpupool_malloc(ctypes.byref(p), 3 << 20, 0, None) == 0
            blocks.append(p.value)
        # This process's holds file (one per process): what a consumer's copy would name.
        hfd, slot = ctypes.c_int(), ctypes.c_uint32()
        assert L.gpupool_share_hold(ctypes.byref(hfd), ctypes.byref(slot)) == 0
        assert L.gpupool_share_release(hfd, slot) == 0 and not gpupool.share._held(slot.value)
        q = queue.Queue()
        done = threading.Event()

        def sender(k):
            try:
                for i in range(k, SENDS, THREADS):
                    s = gpupool.share.export(blocks[k], 3 << 20, 0, Keep(i))
                    if isinstance(s.fds.ident, bytes):   # never sent: its handover goes, its hold stays
                        L.gpupool_handover_withdraw(s.fds.ident, len(s.fds.ident))
                    q.put((i, s.slot))
            except BaseException as e:
                errors.append(repr(e))

        def consumer():
            while True:
                item = q.get()
                if item is None:
                    return
                i, slot = item
                released[i] = 1      # let go: from here the sender may drop its storage
                assert L.gpupool_share_release(hfd, slot) == 0

        def collector():
            try:
                while not done.is_set():
                    gpupool.share.collect()
            except BaseException as e:
                errors.append(repr(e))

        c, g = threading.Thread(target=consumer), threading.Thread(target=collector)
        c.start(); g.start()
        ts = [threading.Thread(target=sender, args=(k,)) for k in range(THREADS)]
        for t in ts: t.start()
        for t in ts: t.join()
        q.put(None); c.join()
        done.set(); g.join()
        left = gpupool.share.collect()
        assert not errors, errors[:3]
        assert not bad, f"{len(bad)} storages dropped while their consumer held them: {bad[:5]}"
        assert left == 0 and gpupool.share.outstanding() == 0, left
        print("ok", SENDS)
    """))
    assert "ok " in out


def test_a_send_that_fails_to_open_releases_its_hold_on_host(library, tmp_path):
    # The direct open (no import made ahead) fails: nothing was mapped, so the send's hold
    # is released at once and the sender may free the block.
    out = ok(run_py("""
        import ctypes, gpupool
        gpupool.configure(0, pool="arena", upstream="host")
        L = gpupool.lib()
        p = ctypes.c_void_p()
        assert L.gpupool_malloc(ctypes.byref(p), 3 << 20, 0, None) == 0
        s = gpupool.share.export(p.value, 3 << 20, 0, object())
        assert gpupool.share.outstanding() == 1
        import os
        # As the consumer receives it: copies of the holds file and of the granules'
        # descriptors; here /dev/null stands where the granule's should be.
        r = gpupool.share.Received.__new__(gpupool.share.Received)
        r.sent, r.lender = s, None
        hfd, slot = ctypes.c_int(), ctypes.c_uint32()   # this process's holds file
        assert L.gpupool_share_hold(ctypes.byref(hfd), ctypes.byref(slot)) == 0
        assert L.gpupool_share_release(hfd, slot) == 0 and not gpupool.share._held(slot.value)
        n = len(set(gpupool.ipc_descriptor_fds(s.desc)))
        r.fds = [os.dup(hfd.value)] + [os.open("/dev/null", os.O_RDONLY) for _ in range(n)]
        try:
            r.open_dlpack(0)
            raise SystemExit("opened")
        except gpupool.GpupoolError as e:
            print("refused:", e)
        assert gpupool.share.collect() == 0, "the failed open kept the send held"
        print("ok")
    """))
    assert "ok" in out


EXPORTER_THAT_EXECS = """
import ctypes, os, sys, gpupool
gpupool.configure(0, pool="arena", upstream="host")
L = gpupool.lib()
p = ctypes.c_void_p()
assert L.gpupool_malloc(ctypes.byref(p), 3 << 20, 0, None) == 0
ctypes.memset(p.value, 0x11, 3 << 20)
print(gpupool.ipc_export(p.value).hex(), flush=True)
sys.stdin.readline()
os.execv("/bin/sleep", ["sleep", "60"])   # the same pid and start time, another program
"""


def test_an_exporter_that_execs_is_not_served_from_mappings_kept_of_it_on_host(library, tmp_path):
    # The importer keeps what it mapped of a process; that process then execs (its pid and
    # start time stay, its record of exports goes). A descriptor from before must be
    # refused, not served from the kept mapping.
    script = tmp_path / "exporter.py"
    script.write_text(EXPORTER_THAT_EXECS)
    out = ok(run_py(f"""
        import os, subprocess, sys, time, gpupool
        gpupool.configure(0, pool="arena", upstream="host")
        child = subprocess.Popen([sys.executable, {str(script)!r}], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True, env=os.environ)
        try:
            desc = bytes.fromhex(child.stdout.readline().strip())
            ptr = gpupool.ipc_open(desc)
            import ctypes
            assert ctypes.string_at(ptr, 4) == b"\\x11" * 4
            gpupool.ipc_close(ptr)
            assert gpupool.stats_json(0)["ipc_imports_kept"] == 1
            child.stdin.write("exec\\n"); child.stdin.flush()
            for _ in range(200):   # until the child runs the other program
                if os.readlink(f"/proc/{{child.pid}}/exe").endswith("sleep"):
                    break
                time.sleep(0.02)
            else:
                raise SystemExit("the child did not exec")
            try:
                again = gpupool.ipc_open(desc)
                raise SystemExit(f"served after the exporter exec'd, at {{again:#x}}")
            except gpupool.GpupoolError as e:
                print("refused:", e)
        finally:
            child.kill()
            child.wait()
        print("ok")
    """))
    assert "ok" in out
