//! A stream destroyed after its last free must never reach the driver again: recording an
//! event on a destroyed stream crashes inside `cuEventRecord` (seen on an H100 when a
//! thread cache was emptied after its thread had destroyed its stream). On the CPU: an
//! upstream that knows which streams are destroyed and lists every call naming one; the
//! thread caches (through the C API), CuPy's stream-less free and the release paths must
//! leave it empty, and the memory freed on a dead stream must still be reused, not stranded.

#[macro_use]
mod common;

use common::MIB;
use gpupool::config::PoolKind;
use gpupool::error::Result;
use gpupool::ffi::core::*;
use gpupool::pool::FreeOn;
use gpupool::stream::StreamHandle;
use gpupool::upstream::host::HostUpstream;
use gpupool::upstream::{AllocError, EventHandle, Events, Ipc, Memory, VirtualMemory};
use gpupool::{Stats, Status};
use std::collections::{HashMap, HashSet};
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

#[derive(Default)]
struct Streams {
    destroyed: HashSet<StreamHandle>,
    /// Streams capturing a graph nobody announced to the pool, with their capture ids.
    capturing: HashMap<StreamHandle, u64>,
    /// Calls that named a destroyed stream, described.
    misuse: Vec<String>,
    device_syncs: usize,
    event_syncs: usize,
    /// Answer `stream_ordered` (the `async` upstream's behaviour: releases queue on a stream).
    stream_ordered: bool,
}

struct CheckingUpstream {
    host: HostUpstream,
    streams: Arc<Mutex<Streams>>,
    next_event: usize,
}

impl CheckingUpstream {
    fn named(&self, what: &str, s: StreamHandle) {
        let mut st = self.streams.lock().unwrap();
        if st.destroyed.contains(&s) {
            st.misuse.push(format!("{what} on destroyed stream {s:#x}"));
        }
    }
}

impl Memory for CheckingUpstream {
    fn name(&self) -> &'static str {
        "checking-host"
    }
    fn allocate(&mut self, size: usize, s: StreamHandle) -> std::result::Result<usize, AllocError> {
        self.named("allocate", s);
        self.host.allocate(size, s)
    }
    fn deallocate(&mut self, a: usize, size: usize, s: StreamHandle) -> Result<()> {
        self.named("deallocate", s);
        self.host.deallocate(a, size, s)
    }
    fn mem_info(&mut self) -> Result<(usize, usize)> {
        self.host.mem_info()
    }
    fn stream_ordered(&self) -> bool {
        self.streams.lock().unwrap().stream_ordered
    }
}

impl VirtualMemory for CheckingUpstream {
    host_address_space!();
}

impl Ipc for CheckingUpstream {}

impl Events for CheckingUpstream {
    fn event_create(&mut self) -> Result<EventHandle> {
        self.next_event += 1;
        Ok(self.next_event)
    }
    fn event_record(&mut self, _ev: EventHandle, s: StreamHandle) -> Result<()> {
        self.named("event record", s);
        Ok(())
    }
    fn event_query(&mut self, _ev: EventHandle) -> Result<bool> {
        Ok(false) // the device is always busy: only a recorded event or a sync frees a block
    }
    fn event_synchronize(&mut self, _ev: EventHandle) -> Result<()> {
        self.streams.lock().unwrap().event_syncs += 1;
        Ok(())
    }
    fn stream_wait_event(&mut self, s: StreamHandle, _ev: EventHandle) -> Result<()> {
        self.named("stream wait", s);
        Ok(())
    }
    fn capture_id(&mut self, s: StreamHandle) -> Result<Option<u64>> {
        self.named("capture info", s);
        Ok(self.streams.lock().unwrap().capturing.get(&s).copied())
    }
    fn set_capture_relaxed(&mut self, _on: bool) {}
    fn synchronize_device(&mut self) -> Result<()> {
        let mut st = self.streams.lock().unwrap();
        if !st.capturing.is_empty() {
            st.misuse.push("device synchronisation during a capture".into());
        }
        st.device_syncs += 1;
        Ok(())
    }
}

fn install(device: i32) -> Arc<Mutex<Streams>> {
    install_as(device, PoolKind::Split, false)
}

fn install_as(device: i32, kind: PoolKind, stream_ordered: bool) -> Arc<Mutex<Streams>> {
    let streams = Arc::new(Mutex::new(Streams { stream_ordered, ..Default::default() }));
    let up = CheckingUpstream { host: HostUpstream::new(1 << 30), streams: streams.clone(), next_event: 0 };
    gpupool::registry::install(device, kind, Box::new(up)).unwrap();
    streams
}

fn stats(device: i32) -> Stats {
    let mut s = Stats { struct_size: std::mem::size_of::<Stats>() as u32, ..Default::default() };
    assert_eq!(unsafe { gpupool_get_stats(device, &mut s) }, Status::Ok);
    s
}

fn malloc_on(size: usize, device: i32, stream: StreamHandle) -> usize {
    let mut p: *mut c_void = std::ptr::null_mut();
    assert_eq!(unsafe { gpupool_malloc(&mut p, size, device, stream as *mut c_void) }, Status::Ok);
    p as usize
}

fn free_on(p: usize, device: i32, stream: StreamHandle) {
    assert_eq!(unsafe { gpupool_free(p as *mut c_void, device, stream as *mut c_void) }, Status::Ok);
}

const E: StreamHandle = 0xe000; // the stream a thread creates, uses and destroys
const S: StreamHandle = 0x5000; // a stream that stays alive

fn set_limit(device: i32, bytes: u64) {
    assert_eq!(gpupool_set_limit(device, bytes as usize), Status::Ok);
}

/// Give every cached segment of `device` back; the bytes released.
fn reclaim(device: i32) -> usize {
    let mut released = 0;
    assert_eq!(unsafe { gpupool_reclaim(device, &mut released) }, Status::Ok);
    released
}

fn check(device: i32) {
    gpupool::registry::with_pool(device, |p| Ok(p.check_invariants())).unwrap().unwrap();
}

fn syncs(streams: &Mutex<Streams>) -> usize {
    streams.lock().unwrap().device_syncs
}

fn misuse(streams: &Mutex<Streams>) -> Vec<String> {
    streams.lock().unwrap().misuse.clone()
}

#[test]
fn a_thread_caches_blocks_of_a_destroyed_stream_go_back_without_touching_it() {
    let d = 40;
    let streams = install(d);
    // A thread works on its own stream: its repeating size is kept in its thread cache at
    // the last free. Then it destroys the stream and exits (the GPU example's eager thread).
    let s2 = streams.clone();
    std::thread::spawn(move || {
        for _ in 0..4 {
            let p = malloc_on(24 * MIB, d, E); // a segment of its own (over 10 MiB)
            free_on(p, d, E);
        }
        s2.lock().unwrap().destroyed.insert(E);
    })
    .join()
    .unwrap();
    // Another thread's allocation reaps the exited thread's cache and must not name E. The
    // dead stream's block is not proven idle, so with memory to spare the pool grows rather
    // than wait for the whole device (no synchronisation on a path that is not failing).
    let p = malloc_on(24 * MIB, d, S);
    assert_eq!(misuse(&streams), Vec::<String>::new());
    assert_eq!(syncs(&streams), 0);
    // Under pressure (the limit refuses growth) one device-wide wait frees it for S.
    let grown = stats(d).n_upstream_allocs;
    set_limit(d, stats(d).total_bytes);
    let q = malloc_on(24 * MIB, d, S);
    assert_eq!(stats(d).n_upstream_allocs, grown, "the dead stream's memory was reused, not stranded");
    assert_eq!(syncs(&streams), 1);
    free_on(p, d, S);
    free_on(q, d, S);
    set_limit(d, 0);
    let released = reclaim(d);
    assert!(released >= 48 * MIB);
    assert_eq!(misuse(&streams), Vec::<String>::new());
    check(d);
}

#[test]
fn a_kept_block_of_a_live_stream_is_covered_when_its_own_stream_allocates_again() {
    let d = 41;
    let streams = install(d);
    // Kept for S, then returned by this thread's own locked allocation on S: S is alive (in
    // use right now), so the return records there and no device-wide wait is needed.
    for _ in 0..3 {
        let p = malloc_on(2 * MIB, d, S);
        free_on(p, d, S);
    }
    let other = malloc_on(3 * MIB, d, S); // a miss: the kept 2 MiB block goes back first
    free_on(other, d, S);
    let q = malloc_on(2 * MIB, d, 0); // the legacy stream takes S's block via its event
    free_on(q, d, 0);
    let st = streams.lock().unwrap();
    assert_eq!(st.misuse, Vec::<String>::new());
    assert_eq!(st.device_syncs, 0, "a live stream's kept blocks need no device-wide wait");
}

#[test]
fn a_stream_less_free_after_the_stream_died_records_nothing_there() {
    let d = 42;
    let streams = install(d);
    let (a, b) = gpupool::registry::with_pool(d, |p| Ok((p.malloc(MIB, E)?, p.malloc(MIB, S)?))).unwrap();
    streams.lock().unwrap().destroyed.insert(E);
    // CuPy frees name no stream: `a` was booked on E (dead), `b` on S, the current stream.
    gpupool::registry::with_pool(d, |p| {
        p.free(a, FreeOn::AsAllocated { current: Some(S) })?;
        p.free(b, FreeOn::AsAllocated { current: Some(S) })
    })
    .unwrap();
    assert_eq!(streams.lock().unwrap().misuse, Vec::<String>::new());
    // Giving the memory back must not order anything on E either.
    let released = reclaim(d);
    assert!(released >= 2 * MIB);
    let st = streams.lock().unwrap();
    assert_eq!(st.misuse, Vec::<String>::new());
    assert!(st.device_syncs >= 1, "E's free was covered by a device-wide wait");
}

#[test]
fn cupy_frees_off_their_stream_in_a_steady_loop_make_no_driver_call() {
    // CuPy's common pattern: allocate inside `with A:`, free after leaving it (the current
    // stream is then the legacy one), allocate the same size on the legacy stream. A's block
    // stays on A (its stream is not named); the legacy stream gets its own block once, and
    // the loop then runs on cached blocks: no device-wide wait, no growth, per step.
    let d = 43;
    let streams = install(d);
    const A: StreamHandle = 0xa000;
    let step = |p: &mut gpupool::Pool| -> Result<()> {
        let a = p.malloc(22 * MIB, A)?;
        p.free(a, FreeOn::AsAllocated { current: Some(0) })?;
        let b = p.malloc(22 * MIB, 0)?;
        p.free(b, 0)
    };
    gpupool::registry::with_pool(d, |p| (0..3).try_for_each(|_| step(p))).unwrap();
    let warm = (stats(d).n_upstream_allocs, syncs(&streams));
    gpupool::registry::with_pool(d, |p| (0..20).try_for_each(|_| step(p))).unwrap();
    assert_eq!((stats(d).n_upstream_allocs, syncs(&streams)), warm);
    assert_eq!(syncs(&streams), 0);
    assert_eq!(misuse(&streams), Vec::<String>::new());
}

#[test]
fn no_device_wide_wait_while_a_capture_nobody_announced_may_run() {
    let d = 44;
    let streams = install(d);
    const C: StreamHandle = 0xc000; // a stream CuPy captures on without telling the pool
    let a = gpupool::registry::with_pool(d, |p| p.malloc(8 * MIB, E)).unwrap();
    streams.lock().unwrap().destroyed.insert(E);
    gpupool::registry::with_pool(d, |p| p.free(a, FreeOn::AsAllocated { current: Some(S) })).unwrap(); // E uncovered
    streams.lock().unwrap().capturing.insert(C, 5);
    let g = gpupool::registry::with_pool(d, |p| p.malloc_detecting_capture(MIB, C)).unwrap();
    // Pressure on another stream while the capture's pool is held: E's memory could only be
    // proven idle by a device-wide wait, which would break the capture. Refused instead.
    set_limit(d, stats(d).total_bytes);
    let r = gpupool::registry::with_pool(d, |p| p.malloc(8 * MIB, S));
    assert!(r.is_err(), "served without proof that E's work is done: {r:?}");
    reclaim(d);
    assert_eq!(syncs(&streams), 0);
    assert_eq!(misuse(&streams), Vec::<String>::new());
    assert!(stats(d).total_bytes >= 8 * MIB as u64, "E's memory stays cached while it cannot be proven idle");
    // The capture ends and its memory is released: now the wait is allowed and E's memory serves.
    streams.lock().unwrap().capturing.clear();
    gpupool::registry::with_pool(d, |p| {
        p.free(g, FreeOn::AsAllocated { current: Some(C) })?;
        p.release_pool((5, gpupool::pool::IMPLICIT_POOL_TAG)).map(|_| ())
    })
    .unwrap();
    // (Releasing the capture's pool waited for the device once; that covers E's frees too.)
    let b = gpupool::registry::with_pool(d, |p| p.malloc(8 * MIB, S)).unwrap();
    assert_eq!(syncs(&streams), 1);
    assert_eq!(misuse(&streams), Vec::<String>::new());
    gpupool::registry::with_pool(d, |p| p.free(b, S)).unwrap();
    set_limit(d, 0);
    check(d);
}

#[test]
fn while_a_route_is_active_a_dead_streams_memory_stays_cached_not_stranded() {
    let d = 45;
    let streams = install(d);
    let a = gpupool::registry::with_pool(d, |p| p.malloc(20 * MIB, E)).unwrap();
    streams.lock().unwrap().destroyed.insert(E);
    gpupool::registry::with_pool(d, |p| p.free(a, FreeOn::AsAllocated { current: Some(S) })).unwrap();
    let reserved = stats(d).total_bytes;
    // A MemPool-like route on another stream: no device-wide wait may happen meanwhile, so
    // reclaim cannot give E's segment back; it must stay in the cache, not in limbo.
    const R: StreamHandle = 0x9000;
    gpupool::registry::with_pool(d, |p| p.begin_allocate_to_pool((9, 9), gpupool::pool::Filter::Stream(gpupool::stream::StreamKey(R as u64)))).unwrap();
    reclaim(d);
    assert_eq!(stats(d).total_bytes, reserved);
    assert!(stats(d).n_free_blocks >= 1 && stats(d).largest_free_block >= 20 * MIB as u64, "E's segment is cached");
    assert_eq!(syncs(&streams), 0);
    gpupool::registry::with_pool(d, |p| {
        p.end_allocate_to_pool((9, 9))?;
        p.release_pool((9, 9)).map(|_| ())
    })
    .unwrap();
    // The route is gone: reclaim may wait for the device now, and gives the segment back.
    let released = reclaim(d);
    assert!(released >= 20 * MIB);
    assert_eq!(syncs(&streams), 1);
    assert_eq!(misuse(&streams), Vec::<String>::new());
    check(d);
}

#[test]
fn a_segment_with_a_dead_streams_block_is_not_handed_out_while_no_wait_may_be_made() {
    let d = 46;
    let streams = install(d);
    const T: StreamHandle = 0x7000;
    let (a, b) = gpupool::registry::with_pool(d, |p| Ok((p.malloc(4 * MIB, E)?, p.malloc(4 * MIB, E)?))).unwrap();
    gpupool::registry::with_pool(d, |p| p.free(b, S)).unwrap(); // covered by S's event
    streams.lock().unwrap().destroyed.insert(E);
    gpupool::registry::with_pool(d, |p| p.free(a, FreeOn::AsAllocated { current: Some(S) })).unwrap(); // E uncovered
    gpupool::registry::with_pool(d, |p| p.begin_allocate_to_pool((9, 9), gpupool::pool::Filter::Stream(gpupool::stream::StreamKey(0x9000)))).unwrap();
    reclaim(d);
    // The segment holds E's block, so it stayed in place with each block's own stream: T
    // may get S's block (after S's event) but never E's without a device-wide wait.
    let t = gpupool::registry::with_pool(d, |p| p.malloc(4 * MIB, T)).unwrap();
    assert!(t != a || syncs(&streams) > 0, "E's block went to T with no wait");
    assert_eq!(syncs(&streams), 0);
    gpupool::registry::with_pool(d, |p| {
        p.free(t, T)?;
        p.end_allocate_to_pool((9, 9))?;
        p.release_pool((9, 9)).map(|_| ())
    })
    .unwrap();
    assert_eq!(misuse(&streams), Vec::<String>::new());
    check(d);
}

#[test]
fn none_on_a_stream_ordered_upstream_queues_releases_on_the_live_stream() {
    let d = 47;
    let streams = install_as(d, PoolKind::None, true);
    for _ in 0..10 {
        let x = malloc_on(MIB, d, S);
        free_on(x, d, S);
    }
    let st = streams.lock().unwrap();
    assert_eq!(st.event_syncs, 0, "a free on a live stream must not block the host");
    assert_eq!(st.misuse, Vec::<String>::new());
}

#[test]
fn an_unannounced_capture_blocks_the_wait_only_until_its_stream_is_seen_idle() {
    let d = 48;
    let streams = install(d);
    const C: StreamHandle = 0xc000;
    // A block CuPy allocated on C before capturing, freed on C during the capture (an event
    // there would belong to the graph): C is uncovered, and the capture is noted.
    let x = gpupool::registry::with_pool(d, |p| p.malloc_detecting_capture(8 * MIB, C)).unwrap();
    streams.lock().unwrap().capturing.insert(C, 7);
    gpupool::registry::with_pool(d, |p| p.free(x, FreeOn::AsAllocated { current: Some(C) })).unwrap();
    set_limit(d, stats(d).total_bytes);
    let r = gpupool::registry::with_pool(d, |p| p.malloc(8 * MIB, S));
    assert!(r.is_err(), "C's block went to S during the capture: {r:?}");
    assert_eq!(syncs(&streams), 0);
    // The capture ends; CuPy's next allocation on C sees it idle (and, growing, records C's
    // event while C is alive): under the same pressure C's block now serves S through that
    // event, with no device-wide wait at all.
    streams.lock().unwrap().capturing.clear();
    set_limit(d, 0);
    let y = gpupool::registry::with_pool(d, |p| p.malloc_detecting_capture(MIB / 2, C)).unwrap();
    set_limit(d, stats(d).total_bytes);
    let z = gpupool::registry::with_pool(d, |p| p.malloc(8 * MIB, S)).unwrap();
    assert_eq!(z, x, "C's block");
    assert_eq!(syncs(&streams), 0);
    assert_eq!(misuse(&streams), Vec::<String>::new());
    gpupool::registry::with_pool(d, |p| {
        p.free(z, S)?;
        p.free(y, FreeOn::AsAllocated { current: Some(C) })
    })
    .unwrap();
    set_limit(d, 0);
    check(d);
}

#[test]
fn memory_of_many_destroyed_streams_is_reused_before_the_pool_grows_without_bound() {
    let d = 49;
    let streams = install(d);
    // A program that creates a stream per task and destroys it while its buffers live on:
    // every free comes after its stream is gone.
    for i in 0..8usize {
        let s = 0x10000 + i * 0x100;
        let x = gpupool::registry::with_pool(d, |p| p.malloc(24 * MIB, s)).unwrap();
        streams.lock().unwrap().destroyed.insert(s);
        gpupool::registry::with_pool(d, |p| p.free(x, FreeOn::AsAllocated { current: Some(S) })).unwrap();
    }
    // Whenever 64 MiB of such frees (here: three tasks' buffers) wait for a device-wide
    // wait, the growth that would follow waits once instead and reuses them: the pool holds
    // three buffers, not eight, for two waits in eight tasks.
    assert_eq!(stats(d).total_bytes, 3 * 24 * MIB as u64);
    assert_eq!(syncs(&streams), 2);
    let y = gpupool::registry::with_pool(d, |p| p.malloc(24 * MIB, S)).unwrap();
    assert_eq!(stats(d).total_bytes, 3 * 24 * MIB as u64, "reused, not grown");
    assert_eq!(syncs(&streams), 2);
    assert_eq!(misuse(&streams), Vec::<String>::new());
    gpupool::registry::with_pool(d, |p| p.free(y, S)).unwrap();
}
