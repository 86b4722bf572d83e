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
use gpupool::stream::StreamHandle;
use gpupool::upstream::host::HostUpstream;
use gpupool::upstream::{AllocError, EventHandle, Upstream};
use gpupool::{Stats, Status};
use std::collections::HashSet;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

#[derive(Default)]
struct Streams {
    destroyed: HashSet<StreamHandle>,
    /// Calls that named a destroyed stream, described.
    misuse: Vec<String>,
    device_syncs: usize,
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

impl Upstream for CheckingUpstream {
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
        Ok(())
    }
    fn stream_wait_event(&mut self, s: StreamHandle, _ev: EventHandle) -> Result<()> {
        self.named("stream wait", s);
        Ok(())
    }
    fn capture_id(&mut self, s: StreamHandle) -> Result<Option<u64>> {
        self.named("capture info", s);
        Ok(None)
    }
    fn synchronize_device(&mut self) -> Result<()> {
        self.streams.lock().unwrap().device_syncs += 1;
        Ok(())
    }
    host_address_space!();
}

fn install(device: i32) -> Arc<Mutex<Streams>> {
    let streams = Arc::new(Mutex::new(Streams::default()));
    let up = CheckingUpstream { host: HostUpstream::new(1 << 30), streams: streams.clone(), next_event: 0 };
    gpupool::registry::install(device, PoolKind::Split, Box::new(up)).unwrap();
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

#[test]
fn a_thread_caches_blocks_of_a_destroyed_stream_go_back_without_touching_it_and_are_reused() {
    let d = 40;
    let streams = install(d);
    // A thread works on its own stream: its repeating size is kept in its thread cache at
    // the last free. Then it destroys the stream and exits (the GPU example's eager thread).
    let s2 = streams.clone();
    std::thread::spawn(move || {
        for _ in 0..4 {
            let p = malloc_on(4 * MIB, d, E);
            free_on(p, d, E);
        }
        s2.lock().unwrap().destroyed.insert(E);
    })
    .join()
    .unwrap();
    let grown = stats(d).n_upstream_allocs;
    // Another thread's allocation reaps the exited thread's cache and must not name E; the
    // dead stream's block serves it after one device-wide wait instead of new memory.
    let p = malloc_on(4 * MIB, d, S);
    assert_eq!(streams.lock().unwrap().misuse, Vec::<String>::new());
    assert_eq!(stats(d).n_upstream_allocs, grown, "the dead stream's memory was reused, not stranded");
    assert_eq!(streams.lock().unwrap().device_syncs, 1);
    free_on(p, d, S);
    let mut released = 0;
    assert_eq!(unsafe { gpupool_reclaim(d, &mut released) }, Status::Ok);
    assert!(released >= 4 * MIB);
    assert_eq!(streams.lock().unwrap().misuse, Vec::<String>::new());
    gpupool::registry::with_pool(d, |p| Ok(p.check_invariants())).unwrap().unwrap();
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
        p.free_as_allocated(a, true, Some(S))?;
        p.free_as_allocated(b, true, Some(S))
    })
    .unwrap();
    assert_eq!(streams.lock().unwrap().misuse, Vec::<String>::new());
    // Giving the memory back must not order anything on E either.
    let mut released = 0;
    assert_eq!(unsafe { gpupool_reclaim(d, &mut released) }, Status::Ok);
    assert!(released >= 2 * MIB);
    let st = streams.lock().unwrap();
    assert_eq!(st.misuse, Vec::<String>::new());
    assert!(st.device_syncs >= 1, "E's free was covered by a device-wide wait");
}
