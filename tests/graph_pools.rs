//! Private pools and CUDA graph capture, on the CPU: an upstream that simulates capturing
//! streams and counts every call a real capture in global mode would not survive (an event
//! recorded or waited on a capturing stream; any query, synchronisation or allocation made
//! outside relaxed capture mode while a capture runs). The GPU tests capture for real.

#[macro_use]
mod common;

use common::MIB;
use gpupool::config::PoolKind;
use gpupool::error::Result;
use gpupool::pool::{Callback, Filter, FreeOn, C_POOL_TAG, IMPLICIT_POOL_TAG};
use gpupool::stream::StreamHandle;
use gpupool::upstream::host::HostUpstream;
use gpupool::upstream::{AliasFail, AllocError, EventHandle, Events, Ipc, Memory, VirtualMemory};
use gpupool::{Pool, PoolOptions};
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::{Arc, Mutex};

#[derive(Default)]
struct Device {
    /// Capturing streams and their capture ids.
    captures: HashMap<StreamHandle, u64>,
    relaxed: bool,
    /// Calls that would invalidate a capture, described.
    forbidden: Vec<String>,
    /// Event records by stream, device synchronisations.
    records: Vec<StreamHandle>,
    device_syncs: usize,
    /// Make event records fail (a driver failure).
    fail_records: bool,
}

struct CaptureUpstream {
    host: HostUpstream,
    dev: Arc<Mutex<Device>>,
    next_event: usize,
}

impl CaptureUpstream {
    /// A call that global capture mode forbids while any capture runs, unless relaxed.
    fn unsafe_call(&self, what: &str) {
        let mut d = self.dev.lock().unwrap();
        if !d.captures.is_empty() && !d.relaxed {
            d.forbidden.push(format!("{what} during a capture, not relaxed"));
        }
    }
    fn on_stream(&self, what: &str, s: StreamHandle) {
        let mut d = self.dev.lock().unwrap();
        if d.captures.contains_key(&s) {
            d.forbidden.push(format!("{what} on capturing stream {s:#x}"));
        }
    }
}

impl Memory for CaptureUpstream {
    fn name(&self) -> &'static str {
        "capture-host"
    }
    fn allocate(&mut self, size: usize, s: StreamHandle) -> std::result::Result<usize, AllocError> {
        self.unsafe_call("allocate");
        self.host.allocate(size, s)
    }
    fn deallocate(&mut self, a: usize, size: usize, s: StreamHandle) -> Result<()> {
        self.unsafe_call("deallocate");
        self.host.deallocate(a, size, s)
    }
    fn mem_info(&mut self) -> Result<(usize, usize)> {
        self.host.mem_info()
    }
}

impl VirtualMemory for CaptureUpstream {
    host_address_space!();
    fn vmm_map_new(&mut self, addr: usize, len: usize) -> std::result::Result<(), AllocError> {
        self.unsafe_call("map");
        self.host.vmm_map_new(addr, len)
    }
    fn vmm_unmap(&mut self, addr: usize, len: usize) -> std::result::Result<(), gpupool::upstream::UnmapFail> {
        self.unsafe_call("unmap");
        self.host.vmm_unmap(addr, len)
    }
    fn vmm_alias(&mut self, homes: &[usize], to: usize) -> std::result::Result<(), AliasFail> {
        self.host.vmm_alias(homes, to)
    }
    fn vmm_unalias(&mut self, addr: usize, len: usize) -> Result<()> {
        self.host.vmm_unalias(addr, len)
    }
}

impl Ipc for CaptureUpstream {}

impl Events for CaptureUpstream {
    fn event_create(&mut self) -> Result<EventHandle> {
        self.next_event += 1;
        Ok(self.next_event)
    }
    fn event_record(&mut self, _ev: EventHandle, s: StreamHandle) -> Result<()> {
        self.on_stream("event record", s);
        let mut d = self.dev.lock().unwrap();
        if d.fail_records {
            return Err(gpupool::Error::Internal("injected: event record failed".into()));
        }
        d.records.push(s);
        Ok(())
    }
    fn event_query(&mut self, _ev: EventHandle) -> Result<bool> {
        self.unsafe_call("event query");
        Ok(false) // the device is always busy: cross-stream reuse must wait
    }
    fn event_synchronize(&mut self, _ev: EventHandle) -> Result<()> {
        self.unsafe_call("event synchronize");
        Ok(())
    }
    fn stream_wait_event(&mut self, s: StreamHandle, _ev: EventHandle) -> Result<()> {
        self.on_stream("stream wait", s);
        Ok(())
    }
    fn capture_id(&mut self, s: StreamHandle) -> Result<Option<u64>> {
        Ok(self.dev.lock().unwrap().captures.get(&s).copied())
    }
    fn set_capture_relaxed(&mut self, on: bool) {
        self.dev.lock().unwrap().relaxed = on;
    }
    fn synchronize_device(&mut self) -> Result<()> {
        self.unsafe_call("device synchronize");
        self.dev.lock().unwrap().device_syncs += 1;
        Ok(())
    }
}

const S: usize = 0x5000; // the capturing stream
const T: usize = 0x7000; // an eager stream

fn pool(kind: PoolKind) -> (Pool, Arc<Mutex<Device>>) {
    let dev = Arc::new(Mutex::new(Device::default()));
    let up = CaptureUpstream { host: HostUpstream::new(1 << 30), dev: dev.clone(), next_event: 0 };
    // A record at every free: these tests are about what happens at that record (batched
    // records are `tests/streams.rs`'s).
    let opts = PoolOptions { kind, check_invariants: true, event_batch: 1, ..Default::default() };
    (Pool::new(0, Box::new(up), &opts).unwrap(), dev)
}

fn begin_capture(dev: &Mutex<Device>, s: StreamHandle, id: u64) {
    dev.lock().unwrap().captures.insert(s, id);
}
fn end_capture(dev: &Mutex<Device>, s: StreamHandle) {
    dev.lock().unwrap().captures.remove(&s);
}
fn forbidden(dev: &Mutex<Device>) -> Vec<String> {
    dev.lock().unwrap().forbidden.clone()
}

fn every_kind(f: impl Fn(PoolKind)) {
    // (`none` gives memory back at each free, which no capture allows; it is a debugging mode.)
    for k in [PoolKind::Split, PoolKind::Binned, PoolKind::Arena] {
        f(k);
    }
}

#[test]
fn a_capture_gets_private_memory_with_no_forbidden_call_and_eager_code_never_sees_it() {
    every_kind(|kind| {
        let (mut p, dev) = pool(kind);
        // Eager history on both streams, so the main cache holds blocks freed on each.
        let before = p.malloc(MIB, S).unwrap();
        for s in [S, T] {
            let x = p.malloc(2 * MIB, s).unwrap();
            p.free(x, s).unwrap();
        }
        begin_capture(&dev, S, 7);
        dev.lock().unwrap().records.clear();
        p.begin_allocate_to_pool((7, 0), Filter::Capture(7)).unwrap();
        let a = p.malloc(MIB, S).unwrap();
        p.free(a, S).unwrap();
        let b = p.malloc(MIB, S).unwrap();
        assert_eq!(a, b, "{kind:?}: a block freed in the capture serves the capture's next request on its stream");
        let c = p.malloc(3 * MIB, S).unwrap();
        p.free(before, S).unwrap(); // an eager block freed on the capturing stream: no event
        end_capture(&dev, S);
        p.end_allocate_to_pool((7, 0)).unwrap();
        assert_eq!(forbidden(&dev), Vec::<String>::new(), "{kind:?}");
        assert!(!dev.lock().unwrap().records.contains(&S), "{kind:?}: an event was recorded on the capturing stream");

        // Eager allocations after the capture: never the graph's memory, live or freed.
        p.free(c, S).unwrap(); // the graph's block, freed eagerly: back to its private pool
        let graph = [(b, MIB), (c, 3 * MIB)];
        for s in [S, T] {
            for size in [MIB, 3 * MIB, 512, 8 * MIB] {
                let e = p.malloc(size, s).unwrap();
                for &(g, len) in &graph {
                    assert!(e + size <= g || e >= g + len, "{kind:?}: eager block {e:#x} overlaps graph block {g:#x}");
                }
                p.free(e, s).unwrap();
            }
        }
        let reserved = p.reserved_bytes();
        let private = p.private_pool_summary().1;
        assert!(private >= 4 * MIB, "{kind:?}: the capture's blocks came from its private pool");
        p.free(b, S).unwrap();
        assert_eq!(p.release_pool((7, 0)).unwrap(), private, "{kind:?}: the private segments went back");
        assert_eq!(p.reserved_bytes(), reserved - private);
        assert_eq!(dev.lock().unwrap().device_syncs, 1, "{kind:?}: one device synchronisation at release");
        assert_eq!(p.private_pool_summary().0, 0);
        p.check_invariants().unwrap();
    });
}

#[test]
fn a_pool_released_with_live_blocks_goes_back_when_the_last_one_is_freed() {
    let (mut p, dev) = pool(PoolKind::Split);
    begin_capture(&dev, S, 3);
    p.begin_allocate_to_pool((3, 0), Filter::Capture(3)).unwrap();
    let out = p.malloc(5 * MIB, S).unwrap();
    end_capture(&dev, S);
    p.end_allocate_to_pool((3, 0)).unwrap();
    let reserved = p.reserved_bytes();
    assert_eq!(p.release_pool((3, 0)).unwrap(), 0, "the graph's output is still live");
    assert_eq!(p.reserved_bytes(), reserved);
    p.free(out, T).unwrap();
    assert!(p.reserved_bytes() < reserved, "freeing the last block released the pool");
    assert_eq!(p.private_pool_summary().0, 0);
    assert_eq!(dev.lock().unwrap().device_syncs, 1);
}

#[test]
fn captures_sharing_a_pool_reuse_its_memory_and_keep_it_until_both_release() {
    let (mut p, dev) = pool(PoolKind::Split);
    let id = (0, 42);
    begin_capture(&dev, S, 1);
    p.begin_allocate_to_pool(id, Filter::Capture(1)).unwrap();
    let a = p.malloc(2 * MIB, S).unwrap();
    p.free(a, S).unwrap();
    end_capture(&dev, S);
    p.end_allocate_to_pool(id).unwrap();
    begin_capture(&dev, S, 2);
    p.begin_allocate_to_pool(id, Filter::Capture(2)).unwrap();
    let b = p.malloc(2 * MIB, S).unwrap();
    assert_eq!(a, b, "the second capture reuses what the first freed (same pool, same stream)");
    p.free(b, S).unwrap();
    end_capture(&dev, S);
    p.end_allocate_to_pool(id).unwrap();
    let uses_left = p.reserved_bytes();
    p.release_pool(id).unwrap();
    assert_eq!(p.reserved_bytes(), uses_left, "one graph still uses the pool");
    p.release_pool(id).unwrap();
    assert_eq!(p.reserved_bytes(), 0);
    assert!(forbidden(&dev).is_empty(), "{:?}", forbidden(&dev));
}

#[test]
fn a_private_block_is_not_reused_on_another_stream() {
    let (mut p, _dev) = pool(PoolKind::Split);
    p.begin_allocate_to_pool((9, C_POOL_TAG), Filter::Stream(gpupool::stream::StreamKey(S as u64))).unwrap();
    let a = p.malloc(MIB, S).unwrap();
    p.free(a, S).unwrap();
    p.end_allocate_to_pool((9, C_POOL_TAG)).unwrap();
    // A route for T into the same pool: S's freed block must not go to T (no event says S is done).
    p.begin_allocate_to_pool((9, C_POOL_TAG), Filter::Stream(gpupool::stream::StreamKey(T as u64))).unwrap();
    let b = p.malloc(MIB, T).unwrap();
    assert_ne!(a, b);
    p.free(b, T).unwrap();
    p.end_allocate_to_pool((9, C_POOL_TAG)).unwrap();
}

unsafe extern "C" fn only_stream_s(ctx: *mut c_void, stream: *mut c_void) -> c_int {
    *(ctx as *mut u32) += 1; // counts calls
    (stream as usize == S) as c_int
}
unsafe extern "C" fn drop_counter(ctx: *mut c_void) {
    drop(Box::from_raw(ctx as *mut u32));
}

#[test]
fn a_callers_predicate_routes_and_is_dropped_when_the_route_ends() {
    let (mut p, _dev) = pool(PoolKind::Split);
    let ctx = Box::into_raw(Box::new(0u32)) as *mut c_void;
    let cb = Callback { call: only_stream_s, ctx, drop: Some(drop_counter) };
    p.begin_allocate_to_pool((5, 0), Filter::Callback(cb)).unwrap();
    let a = p.malloc(MIB, S).unwrap();
    let e = p.malloc(MIB, T).unwrap();
    assert_eq!(p.private_pool_summary().1, 2 * MIB, "S's allocation went to the private pool");
    assert!(p.private_pool_summary().1 < p.reserved_bytes(), "T's did not");
    p.free(a, S).unwrap();
    p.free(e, T).unwrap();
    p.end_allocate_to_pool((5, 0)).unwrap(); // drops the predicate (Box freed: Miri/ASan would see a leak otherwise)
    assert!(p.end_allocate_to_pool((5, 0)).is_err(), "ending twice is an error");
    p.release_pool((5, 0)).unwrap();
    p.release_pool((5, 0)).unwrap(); // released again: ignored
    p.release_pool((77, 77)).unwrap(); // never routed: ignored
    p.check_invariants().unwrap();
}

#[test]
fn a_capture_nobody_announced_gets_its_own_pool_via_cupys_path() {
    let (mut p, dev) = pool(PoolKind::Split);
    begin_capture(&dev, S, 11);
    let a = p.malloc_detecting_capture(MIB, S).unwrap();
    p.free(a, FreeOn::AsAllocated { current: Some(S) }).unwrap();
    let b = p.malloc_detecting_capture(MIB, S).unwrap();
    assert_eq!(a, b);
    p.free(b, FreeOn::AsAllocated { current: Some(S) }).unwrap();
    end_capture(&dev, S);
    assert_eq!(forbidden(&dev), Vec::<String>::new());
    let e = p.malloc_detecting_capture(MIB, S).unwrap();
    assert_ne!(e, a, "the capture's memory stays with it after the capture ends");
    p.free(e, FreeOn::AsAllocated { current: Some(T) }).unwrap();
    assert!(p.release_pool((11, IMPLICIT_POOL_TAG)).unwrap() >= MIB);
}

#[test]
fn a_block_freed_on_a_capturing_stream_moves_only_after_a_record_made_after_the_capture() {
    let (mut p, dev) = pool(PoolKind::Split);
    let x = p.malloc(MIB, S).unwrap();
    let _pin = p.malloc(MIB, S).unwrap(); // keeps x's segment from going back (and coming back at the same address)
    // Some route active (another thread's MemPool, say) makes the pool ask about captures.
    p.begin_allocate_to_pool((1, 1), Filter::Stream(gpupool::stream::StreamKey(0xDEAD))).unwrap();
    begin_capture(&dev, S, 5);
    dev.lock().unwrap().records.clear();
    p.free(x, S).unwrap();
    // While S captures, T must not get x: no event may be recorded on S now.
    let during = p.malloc(MIB, T).unwrap();
    assert_ne!(during, x, "T got a block freed on a stream that is still capturing");
    assert!(!dev.lock().unwrap().records.contains(&S), "an event was recorded on the capturing stream");
    p.free(during, T).unwrap();
    end_capture(&dev, S);
    p.end_allocate_to_pool((1, 1)).unwrap();
    // After the capture a record on S covers every real (eager) use of x: T may have it then.
    let y = p.malloc(MIB, T).unwrap();
    if y == x {
        assert_eq!(dev.lock().unwrap().records, vec![S], "x moved to T without a record on S after the capture");
    }
    p.free(y, T).unwrap();
    assert!(forbidden(&dev).is_empty(), "{:?}", forbidden(&dev));
}

#[test]
fn a_failed_event_record_waits_for_the_device_before_the_block_moves() {
    for kind in [PoolKind::Split, PoolKind::Binned] {
        let (mut p, dev) = pool(kind);
        let x = p.malloc(MIB, S).unwrap();
        dev.lock().unwrap().fail_records = true;
        let syncs = dev.lock().unwrap().device_syncs;
        p.free(x, S).unwrap();
        // No event covers S's free: the pool waited for the whole device instead, after
        // which the block is safe on any stream.
        assert_eq!(dev.lock().unwrap().device_syncs, syncs + 1, "{kind:?}");
        dev.lock().unwrap().fail_records = false;
        let y = p.malloc(MIB, T).unwrap();
        p.free(y, T).unwrap();
        p.check_invariants().unwrap();
    }
}

#[test]
fn a_failed_event_record_during_a_route_keeps_the_block_on_its_stream() {
    // While a route is active a device synchronisation could invalidate a capture: the block
    // then stays on its stream instead.
    let (mut p, dev) = pool(PoolKind::Split);
    p.begin_allocate_to_pool((1, 1), Filter::Stream(gpupool::stream::StreamKey(0xDEAD))).unwrap();
    let x = p.malloc(MIB, S).unwrap();
    dev.lock().unwrap().fail_records = true;
    p.free(x, S).unwrap();
    assert_eq!(dev.lock().unwrap().device_syncs, 0);
    let y = p.malloc(MIB, T).unwrap();
    assert_ne!(x, y, "no event covers S's free, so T must not get its block");
    dev.lock().unwrap().fail_records = false;
    assert_eq!(p.malloc(MIB, S).unwrap(), x, "S itself may reuse it (stream order)");
    p.end_allocate_to_pool((1, 1)).unwrap();
}

#[test]
fn record_stream_on_private_and_capturing_streams_defers_the_reuse() {
    let (mut p, dev) = pool(PoolKind::Split);
    begin_capture(&dev, S, 21);
    begin_capture(&dev, T, 21); // a forked stream in the same capture
    p.begin_allocate_to_pool((21, 0), Filter::Capture(21)).unwrap();
    // A private block also used on T: quarantined, not reused in the capture.
    let a = p.malloc(MIB, S).unwrap();
    p.record_stream(a, T).unwrap();
    p.free(a, S).unwrap();
    let b = p.malloc(MIB, S).unwrap();
    assert_ne!(a, b, "a block used on another stream is not reused during the capture");
    p.free(b, S).unwrap();
    end_capture(&dev, S);
    end_capture(&dev, T);
    // A main-pool block freed during the capture with a capturing extra stream: held, no
    // event recorded on the capturing stream, replayed when the route ends.
    p.end_allocate_to_pool((21, 0)).unwrap();
    let c = p.malloc(MIB, 0x9000).unwrap();
    begin_capture(&dev, S, 22);
    p.begin_allocate_to_pool((22, 0), Filter::Capture(22)).unwrap();
    p.record_stream(c, S).unwrap();
    p.free(c, 0x9000).unwrap();
    assert!(forbidden(&dev).is_empty(), "{:?}", forbidden(&dev));
    end_capture(&dev, S);
    p.end_allocate_to_pool((22, 0)).unwrap();
    p.check_invariants().unwrap();
    p.release_pool((21, 0)).unwrap();
    p.release_pool((22, 0)).unwrap();
    assert_eq!(p.private_pool_summary().0, 0, "both private pools went back once unused");
    assert!(forbidden(&dev).is_empty(), "{:?}", forbidden(&dev));
}

#[test]
fn a_private_pool_released_during_a_route_goes_back_when_the_route_ends() {
    let (mut p, dev) = pool(PoolKind::Split);
    begin_capture(&dev, S, 31);
    p.begin_allocate_to_pool((31, 0), Filter::Capture(31)).unwrap();
    let a = p.malloc(MIB, S).unwrap();
    end_capture(&dev, S);
    p.end_allocate_to_pool((31, 0)).unwrap();
    // Another capture runs while the first graph is destroyed and its output freed: no
    // device synchronisation may happen now.
    begin_capture(&dev, T, 32);
    p.begin_allocate_to_pool((32, 0), Filter::Capture(32)).unwrap();
    p.release_pool((31, 0)).unwrap();
    p.free(a, S).unwrap();
    assert_eq!(dev.lock().unwrap().device_syncs, 0, "no device synchronisation during another capture");
    assert!(forbidden(&dev).is_empty(), "{:?}", forbidden(&dev));
    end_capture(&dev, T);
    p.end_allocate_to_pool((32, 0)).unwrap();
    assert_eq!(p.private_pool_summary().0, 1, "pool 31 went back when the last route ended; 32 is still used");
    assert_eq!(dev.lock().unwrap().device_syncs, 1);
}

#[test]
fn a_stream_less_free_of_a_private_block_goes_back_to_its_pool() {
    let (mut p, _dev) = pool(PoolKind::Split);
    let legacy = gpupool::stream::StreamKey::LEGACY;
    p.begin_allocate_to_pool((41, C_POOL_TAG), Filter::Stream(legacy)).unwrap();
    let a = p.malloc(MIB, 0).unwrap();
    assert_eq!(p.private_pool_summary().0, 1);
    p.free(a, FreeOn::Unordered).unwrap(); // CuPy without its stream getter
    p.check_invariants().unwrap();
    let b = p.malloc(MIB, 0).unwrap();
    assert_eq!(a, b, "the private block went back to its pool and serves the pool again");
    p.free(b, 0).unwrap();
    p.end_allocate_to_pool((41, C_POOL_TAG)).unwrap();
    let e = p.malloc(MIB, 0).unwrap();
    assert_ne!(e, a, "eager code does not get the private block");
    p.free(e, 0).unwrap();
    p.release_pool((41, C_POOL_TAG)).unwrap();
    assert_eq!(p.private_pool_summary().0, 0);
}

#[test]
fn a_growth_on_a_capturing_stream_records_no_event_there() {
    // A route is active that does not take S; S captures a graph and frees there (no event
    // may be recorded: S is uncovered); its next allocation misses the cache and grows. The
    // growth covers an uncovered stream's frees by recording on it, but not while it captures.
    every_kind(|kind| {
        let (mut p, dev) = pool(kind);
        p.begin_allocate_to_pool((1, 1), Filter::Stream(gpupool::stream::StreamKey(0xDEAD))).unwrap();
        let x = p.malloc(MIB, S).unwrap();
        begin_capture(&dev, S, 7);
        p.free(x, S).unwrap();
        let y = p.malloc(64 * MIB, S).unwrap();
        let recorded: Vec<String> = forbidden(&dev).into_iter().filter(|f| f.starts_with("event record")).collect();
        assert!(recorded.is_empty(), "{kind:?}: {recorded:?}");
        end_capture(&dev, S);
        p.free(y, S).unwrap();
        p.check_invariants().unwrap();
    });
}

#[test]
fn an_eviction_that_cannot_wait_for_its_stream_does_not_plan_it_again_forever() {
    // The arena's stitch cache is full (its address space is), the stitch to evict was last
    // freed on S with frees pending (batched records), and a route forbids the device-wide
    // wait: the eviction fails, and the growth must go on without it (a window, or out of
    // memory), not choose the same stitch again and again under the pool lock. (Here, not in
    // tests/streams.rs: a route makes every thread cache in the process step aside while it
    // is active, which would disturb that file's steady-state test running beside it.)
    let dev = Arc::new(Mutex::new(Device::default()));
    let up = CaptureUpstream { host: HostUpstream::new(1 << 30), dev: dev.clone(), next_event: 0 };
    let opts = PoolOptions { kind: PoolKind::Arena, check_invariants: true, arena_va: Some(16 * MIB), ..Default::default() };
    let mut p = Pool::new(0, Box::new(up), &opts).unwrap();
    let blocks: Vec<usize> = (0..8).map(|_| p.malloc(2 * MIB, S).unwrap()).collect();
    for i in [0, 2, 4, 6] {
        p.free(blocks[i], S).unwrap();
    }
    let stitched = p.malloc(8 * MIB, S).unwrap();
    assert!(p.arena_figures().unwrap().counters.stitches_made >= 1);
    p.free(stitched, S).unwrap();
    p.free(blocks[1], S).unwrap();
    p.begin_allocate_to_pool((1, 1), Filter::Stream(gpupool::stream::StreamKey(0xDEAD))).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let worker = std::thread::spawn(move || {
        let r = p.malloc(10 * MIB, T);
        tx.send(r.is_ok()).unwrap();
        p
    });
    assert!(rx.recv_timeout(std::time::Duration::from_secs(20)).is_ok(), "the growth never returned");
    let mut p = worker.join().unwrap();
    p.end_allocate_to_pool((1, 1)).unwrap();
    p.check_invariants().unwrap();
}

#[test]
fn a_mempool_is_kept_while_used_and_its_memory_goes_back_with_its_last_release() {
    // PyTorch's MemPool: the constructor makes the pool (one use), each `use_mem_pool`
    // scope begins (one more use) and releases, the destructor releases and empties it.
    let (mut p, _dev) = pool(PoolKind::Split);
    let id = (0, 77);
    p.create_or_incref_pool(id).unwrap();
    assert_eq!(p.pool_use_count(id), 1);
    let key = p.stream_key(T).unwrap();
    p.begin_allocate_to_pool(id, Filter::Stream(key)).unwrap();
    assert_eq!(p.pool_use_count(id), 2);
    let a = p.malloc(3 * MIB, T).unwrap();
    p.end_allocate_to_pool(id).unwrap();
    p.release_pool(id).unwrap();
    assert_eq!(p.pool_use_count(id), 1);
    let reserved = p.reserved_bytes();
    assert!(reserved >= 3 * MIB);
    p.free(a, T).unwrap();
    assert_eq!(p.empty_private_pool(id).unwrap(), 0, "the MemPool still holds the pool: its memory stays");
    assert_eq!(p.reserved_bytes(), reserved);
    p.release_pool(id).unwrap();
    assert_eq!(p.pool_use_count(id), 0, "released: the pool is gone");
    assert_eq!(p.reserved_bytes(), 0);
    assert_eq!(p.empty_private_pool(id).unwrap(), 0, "emptying a pool that is gone is no error");
}

#[test]
fn peaks_start_again_from_what_is_held_now() {
    let (mut p, _dev) = pool(PoolKind::Split);
    let a = p.malloc(8 * MIB, T).unwrap();
    let b = p.malloc(MIB, T).unwrap();
    p.free(a, T).unwrap();
    let s = p.stats();
    assert!(s.peak_used_bytes >= 9 * MIB as u64 && s.used_bytes < s.peak_used_bytes, "{s:?}");
    p.reset_peaks();
    let s = p.stats();
    assert_eq!(s.peak_used_bytes, s.used_bytes);
    assert_eq!(s.peak_total_bytes, s.total_bytes);
    assert_eq!(s.peak_requested_bytes, s.requested_bytes);
    p.free(b, T).unwrap();
}

/// Two pools of one device (a tag's pool holding a capture's route, and shard 0 without
/// one) share a budget. A free in shard 0 on the capturing stream during that capture must
/// not keep the capture noted as one nobody announced once it ended: shard 0's released
/// graph pool goes back.
#[test]
fn a_capture_announced_in_another_pool_of_the_device_is_not_noted_past_its_end() {
    let dev = Arc::new(Mutex::new(Device::default()));
    let budget = Arc::new(gpupool::pool::Budget::default());
    let make = || {
        let up = CaptureUpstream { host: HostUpstream::new(1 << 30), dev: dev.clone(), next_event: 0 };
        let opts = PoolOptions { kind: PoolKind::Split, check_invariants: true, event_batch: 1, budget: Some(budget.clone()), ..Default::default() };
        Pool::new(0, Box::new(up), &opts).unwrap()
    };
    let (mut tag, mut shard0) = (make(), make());
    begin_capture(&dev, S, 1);
    shard0.begin_allocate_to_pool((1, 0), Filter::Capture(1)).unwrap();
    let g = shard0.malloc(MIB, S).unwrap();
    shard0.free(g, S).unwrap();
    end_capture(&dev, S);
    shard0.end_allocate_to_pool((1, 0)).unwrap();
    let eager = shard0.malloc(MIB, S).unwrap();
    begin_capture(&dev, S, 7);
    tag.begin_allocate_to_pool((7, 0), Filter::Capture(7)).unwrap();
    assert!(budget.routes_active());
    shard0.free(eager, S).unwrap(); // an eager block freed on the capturing stream
    end_capture(&dev, S);
    tag.end_allocate_to_pool((7, 0)).unwrap();
    shard0.settle_after_captures();
    assert!(!budget.routes_active());
    assert!(shard0.release_pool((1, 0)).unwrap() > 0, "shard 0's released graph pool went back");
    assert!(forbidden(&dev).is_empty(), "{:?}", forbidden(&dev));
}
