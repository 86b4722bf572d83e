//! The per-thread fast path (`src/thread_cache/`) through the C API, on the host upstream:
//! same-size reuse skips the pool, yet statistics, double-free detection, frees from other
//! threads, reclaim, limits, thread exit and reconfiguration behave exactly as without it.
//! Each test uses its own device id (tests run in parallel in one process).

use gpupool::ffi::core::*;
use gpupool::ffi::graph::{gpupool_begin_allocate_to_pool, gpupool_end_allocate_to_pool, gpupool_release_pool};
use gpupool::Status;
use std::ffi::{c_char, c_void, CStr};
use std::ptr::null_mut;

#[macro_use]
mod common;
use common::{device_stats as stats, last_error as last};

const MIB: usize = 1 << 20;

fn host(device: i32) {
    assert_eq!(unsafe { gpupool_configure(device, c"split".as_ptr(), c"host".as_ptr()) }, Status::Ok, "{}", last());
}



fn malloc_on(size: usize, device: i32, stream: usize) -> usize {
    let mut p: *mut c_void = null_mut();
    assert_eq!(unsafe { gpupool_malloc(&mut p, size, device, stream as *mut c_void) }, Status::Ok, "{}", last());
    p as usize
}

fn malloc(size: usize, device: i32) -> usize {
    malloc_on(size, device, 0)
}

fn free(p: usize, device: i32) -> Status {
    unsafe { gpupool_free(p as *mut c_void, device, null_mut()) }
}

fn check(device: i32) {
    gpupool::registry::with_pool(device, |p| Ok(p.check_invariants())).unwrap().unwrap();
}

/// Return every cached segment of `device` to the upstream.
fn reclaim(device: i32) {
    let mut released = 0;
    assert_eq!(unsafe { gpupool_reclaim(device, &mut released) }, Status::Ok);
}

/// Blocks freed by their users and kept in thread caches.
fn kept(device: i32) -> usize {
    gpupool::registry::with_pool(device, |p| Ok(p.thread_caches().1)).unwrap()
}

/// Allocate `size` and free it: a size enters the thread cache once it repeats.
fn warm(size: usize, device: i32) {
    let p = malloc(size, device);
    assert_eq!(free(p, device), Status::Ok);
}

#[test]
fn same_size_reuse_is_fast_and_stats_stay_exact() {
    let d = 20;
    host(d);
    let first = malloc(MIB, d);
    assert_eq!(free(first, d), Status::Ok);
    assert_eq!(kept(d), 0, "a size met once is not kept");
    let a = malloc(MIB, d);
    assert_eq!(free(a, d), Status::Ok);
    assert_eq!(kept(d), 1, "a repeating size is");
    let s = stats(d);
    assert_eq!((s.used_bytes, s.n_live_blocks, s.requested_bytes), (0, 0, 0), "a parked block reads as freed");
    assert_eq!((s.n_allocs, s.n_frees), (2, 2));
    assert_eq!(s.free_bytes, s.total_bytes);
    assert!(gpupool::thread_cache::current(d).is_some(), "the thread got a cache");
    for i in 0..1000 {
        let b = malloc(MIB, d);
        assert_eq!(b, a, "round {i}: the parked block comes back");
        assert_eq!(stats(d).used_bytes, MIB as u64);
        assert_eq!(free(b, d), Status::Ok);
    }
    let s = stats(d);
    assert_eq!((s.n_allocs, s.n_frees, s.used_bytes, s.n_upstream_allocs), (1002, 1002, 0, 1));
    assert_eq!(s.peak_used_bytes, MIB as u64);
    // Another size: the locked path, which first returns the parked block to the pool.
    let c = malloc(MIB / 2, d);
    check(d);
    let s = stats(d);
    assert_eq!((s.used_bytes, s.n_live_blocks, s.n_allocs), ((MIB / 2) as u64, 1, 1003));
    assert_eq!(kept(d), 0);
    assert_eq!(free(c, d), Status::Ok);
    let mut leaks = vec![0u8; 4096];
    unsafe { gpupool_report_leaks(leaks.as_mut_ptr() as *mut c_char, leaks.len()) };
    let report = CStr::from_bytes_until_nul(&leaks).unwrap().to_str().unwrap();
    assert!(!report.contains(&format!("{a:#x}")), "parked blocks are not leaks: {report}");
}

#[test]
fn double_free_of_a_parked_block_is_caught_on_any_thread() {
    let d = 21;
    host(d);
    warm(4096, d);
    let a = malloc(4096, d);
    assert_eq!(free(a, d), Status::Ok);
    assert_eq!(kept(d), 1);
    assert_eq!(free(a, d), Status::InvalidPointer, "second free on the same thread");
    assert!(last().contains("double free"), "{}", last());
    let st = std::thread::spawn(move || (free(a, d), last())).join().unwrap();
    assert_eq!(st.0, Status::InvalidPointer, "second free on another thread");
    assert!(st.1.contains("double free"), "{}", st.1);
    assert_eq!(unsafe { gpupool_record_stream(a as *mut c_void, null_mut()) }, Status::InvalidPointer);
    let s = stats(d);
    assert_eq!((s.n_invalid_frees, s.n_frees, s.used_bytes), (2, 2, 0));
    // The block is still good for its thread's next allocation of that size.
    assert_eq!(malloc(4096, d), a);
    assert_eq!(free(a, d), Status::Ok);
    check(d);
}

#[test]
fn a_block_freed_by_another_thread_leaves_the_fast_path() {
    let d = 22;
    host(d);
    warm(8192, d);
    let a = malloc(8192, d);
    assert_eq!(gpupool::registry::with_pool(d, |p| Ok(p.thread_caches().0)).unwrap(), 1);
    assert_eq!(std::thread::spawn(move || free(a, d)).join().unwrap(), Status::Ok);
    assert_eq!(stats(d).used_bytes, 0);
    // The allocating thread may not park it any more: its free is a double free.
    assert_eq!(free(a, d), Status::InvalidPointer);
    assert!(last().contains("double free"), "{}", last());
    check(d);
    // record_stream takes a block off the fast path too: its free waits for the stream.
    let b = malloc(8192, d);
    assert_eq!(unsafe { gpupool_record_stream(b as *mut c_void, 0x77 as *mut c_void) }, Status::Ok);
    assert_eq!(free(b, d), Status::Ok);
    check(d);
    assert_eq!(stats(d).n_deferred_frees, 1, "the free went through the pool and was deferred");
}

#[test]
fn user_streams_take_the_fast_path_each_for_itself() {
    let d = 23;
    host(d);
    let (s, t) = (0x5000usize, 0x7000usize);
    // Warm the size on stream s: it repeats, so the block is remembered for s.
    for _ in 0..2 {
        let a = malloc_on(MIB, d, s);
        assert_eq!(unsafe { gpupool_free(a as *mut c_void, d, s as *mut c_void) }, Status::Ok);
    }
    let a = malloc_on(MIB, d, s);
    assert!(gpupool::thread_cache::try_free(d, a, s), "a user stream's free is kept for that stream");
    assert_eq!(gpupool::thread_cache::try_malloc(d, MIB, t), None, "another stream never gets it from the fast path");
    assert_eq!(gpupool::thread_cache::try_malloc(d, MIB, 0), None, "nor does the legacy stream");
    assert_eq!(gpupool::thread_cache::try_malloc(d, MIB, s), Some(a), "its own stream does");
    // A free that names another stream than the allocation's goes to the pool.
    assert!(!gpupool::thread_cache::try_free(d, a, t));
    assert_eq!(unsafe { gpupool_free(a as *mut c_void, d, t as *mut c_void) }, Status::Ok);
    assert_eq!(kept(d), 0);
    // The per-thread default stream (another stream on each thread) never takes it.
    let p = malloc_on(MIB, d, 2);
    assert!(!gpupool::thread_cache::try_free(d, p, 2));
    assert_eq!(unsafe { gpupool_free(p as *mut c_void, d, 2 as *mut c_void) }, Status::Ok);
    // A kept user-stream block goes back to the pool on its own stream when flushed.
    let b = malloc_on(MIB, d, s);
    assert!(gpupool::thread_cache::try_free(d, b, s));
    reclaim(d);
    assert_eq!(kept(d), 0);
    assert_eq!(stats(d).n_live_blocks, 0);
    check(d);
}

#[test]
fn reclaim_limits_and_growth_reach_parked_blocks() {
    let d = 24;
    host(d);
    // A thread parks a 64 MiB block (its own segment), then waits.
    let (tx, rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let t = std::thread::spawn(move || {
        warm(64 * MIB, d);
        let a = malloc(64 * MIB, d);
        assert_eq!(free(a, d), Status::Ok);
        assert_eq!(kept(d), 1);
        tx.send(a).unwrap();
        go_rx.recv().unwrap();
        // After another thread took the block, this thread's cache no longer offers it.
        let b = malloc(64 * MIB, d);
        assert_eq!(free(b, d), Status::Ok);
    });
    let a = rx.recv().unwrap();
    assert_eq!(stats(d).total_bytes, 64 << 20);
    // Growth: with a limit of one segment, another thread's request is served by the
    // parked block instead of failing.
    assert_eq!(gpupool_set_limit(d, 64 * MIB), Status::Ok);
    let b = malloc(64 * MIB, d);
    assert_eq!(b, a, "the parked block was flushed and reused");
    assert_eq!(stats(d).n_upstream_allocs, 1);
    assert_eq!(free(b, d), Status::Ok);
    go_tx.send(()).unwrap();
    t.join().unwrap();
    assert_eq!(gpupool_set_limit(d, 0), Status::Ok);
    // Reclaim from this thread returns what the exited thread had parked.
    reclaim(d);
    let s = stats(d);
    assert_eq!((s.total_bytes, s.used_bytes, s.n_live_blocks), (0, 0, 0), "everything went back");
    assert_eq!(s.n_allocs, s.n_frees);
    check(d);
}

#[test]
fn exited_threads_caches_are_flushed_and_dropped() {
    let d = 25;
    host(d);
    // All allocate before any exits, so none of them reaps another's cache.
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(50));
    let threads: Vec<_> = (0..50)
        .map(|_| {
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                warm(3000, d);
                let a = malloc(3000, d);
                assert_eq!(free(a, d), Status::Ok);
                barrier.wait();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let s = stats(d);
    assert_eq!((s.n_allocs, s.n_frees, s.used_bytes), (100, 100, 0));
    assert_eq!(kept(d), 50, "each exited thread left a kept block");
    let caches = || gpupool::registry::with_pool(d, |p| Ok(p.thread_caches().0)).unwrap();
    assert_eq!(caches(), 50, "exited threads' caches wait for the next locked operation");
    // The next locked allocation reaps the orphans; their parked blocks go back.
    let a = malloc(100, d);
    assert_eq!(caches(), 1, "only this thread's cache is left");
    assert_eq!(kept(d), 0);
    assert_eq!(stats(d).n_free_blocks, 1, "the 50 parked blocks coalesced back into one free block");
    assert_eq!(free(a, d), Status::Ok);
    check(d);
    reclaim(d);
    assert_eq!(stats(d).total_bytes, 0);
}

#[test]
fn reconfiguring_flushes_parked_blocks_and_starts_clean() {
    let d = 26;
    host(d);
    warm(MIB, d);
    let a = malloc(MIB, d);
    assert_eq!(free(a, d), Status::Ok);
    assert_eq!(kept(d), 1);
    // The parked block is not a live allocation: reconfiguring is allowed.
    assert_eq!(unsafe { gpupool_configure(d, c"binned".as_ptr(), c"host".as_ptr()) }, Status::Ok, "{}", last());
    assert_eq!(free(a, d), Status::InvalidPointer, "the old pool's block is gone");
    warm(MIB, d);
    let b = malloc(MIB, d);
    assert_eq!(free(b, d), Status::Ok);
    assert_eq!(kept(d), 1, "the fast path works with the new pool");
    assert_eq!(malloc(MIB, d), b);
    assert_eq!(free(b, d), Status::Ok);
    let s = stats(d);
    assert_eq!((s.n_allocs, s.n_frees, s.used_bytes), (3, 3, 0));
    check(d);
}

#[test]
fn threads_hammering_with_cross_thread_frees_stay_consistent() {
    let d = 27;
    host(d);
    let (tx, rx) = std::sync::mpsc::channel::<usize>();
    let consumer = std::thread::spawn(move || {
        let mut n = 0;
        for p in rx {
            assert_eq!(free(p, d), Status::Ok);
            n += 1;
        }
        n
    });
    let workers: Vec<_> = (0..8)
        .map(|t| {
            let tx = tx.clone();
            std::thread::spawn(move || {
                let mut held = Vec::new();
                for i in 0..5000usize {
                    let size = [256, 4096, MIB, 3 * MIB][(i + t) % 4];
                    let p = malloc(size, d);
                    match i % 5 {
                        0 => tx.send(p).unwrap(),
                        1 => held.push(p),
                        _ => assert_eq!(free(p, d), Status::Ok),
                    }
                    if held.len() > 3 {
                        assert_eq!(free(held.remove(0), d), Status::Ok);
                    }
                }
                for p in held {
                    assert_eq!(free(p, d), Status::Ok);
                }
            })
        })
        .collect();
    drop(tx);
    for w in workers {
        w.join().unwrap();
    }
    assert_eq!(consumer.join().unwrap(), 8 * 1000);
    check(d);
    let s = stats(d);
    assert_eq!((s.n_allocs, s.n_frees, s.used_bytes, s.n_live_blocks, s.n_invalid_frees), (40000, 40000, 0, 0, 0));
}

fn cupy_malloc(size: usize, device: i32) -> usize {
    let p = unsafe { gpupool::ffi::cupy::gpupool_cupy_malloc(null_mut(), size, device) } as usize;
    assert_ne!(p, 0, "{}", last());
    p
}

fn cupy_free(p: usize, device: i32) {
    unsafe { gpupool::ffi::cupy::gpupool_cupy_free(null_mut(), p as *mut c_void, device) };
}

#[test]
fn cupy_frees_are_reused_only_after_a_batched_fence() {
    use gpupool::thread_cache::FENCE_BATCH;
    let d = 28;
    host(d);
    // Until a fence is recorded no CuPy-freed block comes back, so each allocation is new.
    // (The first block of a size is not kept: a size enters the cache once it repeats.)
    let mut seen = Vec::new();
    for _ in 0..=FENCE_BATCH {
        let p = cupy_malloc(MIB, d);
        assert!(!seen.contains(&p), "{p:#x} reused before a fence");
        seen.push(p);
        cupy_free(p, d);
    }
    let s = stats(d);
    let n = FENCE_BATCH as u64 + 1;
    assert_eq!((s.used_bytes, s.n_live_blocks, s.n_allocs, s.n_frees), (0, 0, n, n));
    // The next allocation records one fence; from then on the batch cycles.
    for i in 0..10 * FENCE_BATCH {
        let p = cupy_malloc(MIB, d);
        assert!(seen.contains(&p), "round {i}: {p:#x} is not one of the fenced blocks");
        cupy_free(p, d);
    }
    let s = stats(d);
    assert_eq!((s.used_bytes, s.n_allocs, s.n_frees, s.n_invalid_frees), (0, n + 10 * FENCE_BATCH as u64, n + 10 * FENCE_BATCH as u64, 0));
    check(d);
    // A double free of a kept block is counted, not fatal; nothing changes.
    let p = cupy_malloc(MIB, d);
    cupy_free(p, d);
    cupy_free(p, d);
    assert_eq!(stats(d).n_invalid_frees, 1);
    check(d);
    // Reclaim takes the magazine back too, fenced or not.
    reclaim(d);
    let s = stats(d);
    assert_eq!((s.total_bytes, s.used_bytes, s.n_live_blocks), (0, 0, 0));
    check(d);
}

/// A host device whose driver refuses event records while `refuse` is set.
struct RefusingRecords {
    host: gpupool::upstream::host::HostUpstream,
    refuse: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl gpupool::upstream::Memory for RefusingRecords {
    fn name(&self) -> &'static str {
        "refusing-records"
    }
    host_memory!();
}

impl gpupool::upstream::VirtualMemory for RefusingRecords {}

impl gpupool::upstream::Ipc for RefusingRecords {}

impl gpupool::upstream::Events for RefusingRecords {
    fn event_record(&mut self, _ev: gpupool::upstream::EventHandle, _s: gpupool::stream::StreamHandle) -> gpupool::error::Result<()> {
        if self.refuse.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(gpupool::error::Error::Cuda { call: "cuEventRecord", code: 999, name: "refused".into() });
        }
        Ok(())
    }
}

#[test]
fn cupy_frees_stay_unfenced_while_the_fence_cannot_be_recorded() {
    use gpupool::thread_cache::FENCE_BATCH;
    use std::sync::atomic::{AtomicBool, Ordering};
    let d = 32;
    let refuse = std::sync::Arc::new(AtomicBool::new(true));
    let up = RefusingRecords { host: gpupool::upstream::host::HostUpstream::new(1 << 30), refuse: refuse.clone() };
    gpupool::registry::install(d, gpupool::config::PoolKind::Split, Box::new(up)).unwrap();
    // A full batch of CuPy frees, then allocations whose fences all fail: nothing comes back.
    let mut seen = Vec::new();
    for i in 0..4 * FENCE_BATCH {
        let p = cupy_malloc(MIB, d);
        assert!(!seen.contains(&p), "allocation {i}: {p:#x} reused though no fence was recorded");
        seen.push(p);
        cupy_free(p, d);
    }
    assert!(kept(d) > 0, "the magazine holds the unfenced frees");
    check(d);
    // Records work again: the next allocation's fence makes them reusable.
    refuse.store(false, Ordering::SeqCst);
    let p = cupy_malloc(MIB, d);
    assert!(seen.contains(&p), "{p:#x}: a fenced block is reused");
    cupy_free(p, d);
    let s = stats(d);
    assert_eq!((s.used_bytes, s.n_live_blocks, s.n_invalid_frees), (0, 0, 0));
    check(d);
}

#[test]
fn blocks_cross_between_cupy_and_legacy_stream_frees() {
    let d = 29;
    host(d);
    // A CuPy allocation freed through the C API (e.g. a DLPack export) leaves the magazine.
    cupy_free(cupy_malloc(4096, d), d);
    let p = cupy_malloc(4096, d);
    assert_eq!(gpupool::thread_cache::try_malloc(d, 4096, 0), None);
    assert_eq!(free(p, d), Status::Ok);
    cupy_free(p, d);
    assert_eq!(stats(d).n_invalid_frees, 1, "its CuPy free after that is a double free");
    // A legacy-stream allocation freed by CuPy goes through the pool's fenced path.
    warm(4096, d);
    let q = malloc(4096, d);
    cupy_free(q, d);
    assert_eq!(kept(d), 0);
    assert_eq!(stats(d).used_bytes, 0);
    assert_eq!(free(q, d), Status::InvalidPointer);
    check(d);
}

#[test]
fn the_magazine_holds_cupy_frees_only_while_their_sizes_repeat() {
    let d = 31;
    host(d);
    // Sizes that never repeat (a churning program): blocks are not even remembered, so each
    // free reaches the pool's own batch at once, as it would without the cache.
    let mut live: Vec<usize> = Vec::new();
    for i in 0..2000usize {
        let size = 4096 + (i * 7919) % 65536 * 64;
        live.push(cupy_malloc(size, d));
        if live.len() > 8 {
            cupy_free(live.remove(i % 8), d);
        }
        assert_eq!(kept(d), 0, "step {i}: the magazine kept frees of sizes not asked for again");
    }
    for p in live {
        cupy_free(p, d);
    }
    // Two repeating sizes in turn: a miss for one hands the other's unfenced frees to the
    // pool's batch, so the magazine never sits on frees the thread is not asking for.
    for i in 0..200usize {
        let p = cupy_malloc([5 * MIB, 6 * MIB][i % 2], d);
        cupy_free(p, d);
        assert!(kept(d) <= 1, "step {i}: {} kept", kept(d));
    }
    // A repeating size keeps its frees until a fence makes them reusable (from its second
    // allocation on: the first is what makes it a repeating size).
    for _ in 0..5 {
        let p = cupy_malloc(3 * MIB, d);
        cupy_free(p, d);
    }
    assert_eq!(kept(d), 4);
    check(d);
    let s = stats(d);
    assert_eq!((s.used_bytes, s.n_allocs, s.n_frees), (0, 2205, 2205));
}

#[test]
fn an_allocation_of_nothing_takes_no_pools_lock_but_still_checks_the_device() {
    let d = 33;
    host(d);
    // Another thread holds the pool (as an import made ahead does for its driver calls);
    // empty tensors made meanwhile must not wait for it.
    let (held_tx, held_rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let holder = std::thread::spawn(move || {
        gpupool::registry::with_pool(d, |_| {
            held_tx.send(()).unwrap();
            // Held until the main thread's empty allocations are done (or a minute passed).
            let _ = done_rx.recv_timeout(std::time::Duration::from_secs(60));
            Ok(())
        })
        .unwrap();
    });
    held_rx.recv().unwrap();
    let (waiter_tx, waiter_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // The default stream: shard 0, the one held.
        let mut p: *mut c_void = 1 as *mut c_void;
        let a = unsafe { gpupool_malloc(&mut p, 0, d, null_mut()) };
        waiter_tx.send((a, p as usize)).unwrap();
    });
    let got = waiter_rx.recv_timeout(std::time::Duration::from_secs(30));
    done_tx.send(()).unwrap();
    holder.join().unwrap();
    assert_eq!(got, Ok((Status::Ok, 0)), "0 bytes: NULL, without waiting for the pool's lock");
    // Where the pool is not made yet, nothing is answered as the pool would: a bad device,
    // and a device with no driver here (no pool configured on this id), are refused.
    let mut p: *mut c_void = null_mut();
    assert_eq!(unsafe { gpupool_malloc(&mut p, 0, 4096, null_mut()) }, Status::InvalidDevice, "a bad device is still refused");
    let (zero, one) = unsafe { (gpupool_malloc(&mut p, 0, 47, null_mut()), gpupool_malloc(&mut p, 1, 47, null_mut())) };
    assert_ne!(zero, Status::Ok, "device 47 has no pool and no driver here: {}", last());
    assert_eq!(zero, one, "nothing is refused as something is");
}

#[test]
fn peaks_are_at_least_what_is_live_after_a_block_comes_back_from_a_thread_cache() {
    let d = 34;
    host(d);
    // Free memory that another thread's 3 MiB can take without growing (a size met once
    // goes back to the pool).
    let room = malloc(2 * MIB, d);
    assert_eq!(free(room, d), Status::Ok);
    warm(4 * MIB, d);
    let a = malloc(4 * MIB, d);
    assert_eq!(free(a, d), Status::Ok);
    assert_eq!(kept(d), 1);
    // Another thread's locked allocation (this thread's own would hand its parked block back
    // to the pool first): its peak counts it beside nothing live, as the parked block was
    // freed by its user.
    let b = std::thread::spawn(move || malloc(3 * MIB, d)).join().unwrap();
    assert_eq!(kept(d), 1, "another thread's allocation that needs no growth leaves it parked");
    let s = stats(d);
    assert_eq!((s.peak_used_bytes, s.peak_requested_bytes), (4 * MIB as u64, 4 * MIB as u64), "{s:?}");
    // The parked block comes back with no locked call: 7 MiB live, a peak no locked call saw.
    let c = malloc(4 * MIB, d);
    assert_eq!((c, kept(d)), (a, 0), "the fast path served it");
    let s = stats(d);
    assert_eq!(s.used_bytes, 7 * MIB as u64);
    assert_eq!((s.peak_used_bytes, s.peak_requested_bytes), (7 * MIB as u64, 7 * MIB as u64), "a peak never reads below what is live: {s:?}");
    assert_eq!(free(b, d), Status::Ok);
    assert_eq!(free(c, d), Status::Ok);
    check(d);
}

#[test]
fn a_private_pools_allocation_does_not_count_parked_blocks_in_the_peaks() {
    let d = 35;
    host(d);
    warm(4 * MIB, d);
    let a = malloc(4 * MIB, d);
    assert_eq!(free(a, d), Status::Ok);
    assert_eq!(kept(d), 1, "4 MiB parked: freed by its user, still counted in the pool's used bytes");
    // Allocations routed to a private pool (as a graph capture's are) take another path.
    assert_eq!(unsafe { gpupool_begin_allocate_to_pool(d, 5, null_mut()) }, Status::Ok, "{}", last());
    let b = malloc(MIB, d);
    assert_eq!(gpupool_end_allocate_to_pool(d, 5), Status::Ok);
    let s = stats(d);
    assert_eq!(s.used_bytes, MIB as u64);
    assert_eq!(
        (s.peak_used_bytes, s.peak_requested_bytes),
        (4 * MIB as u64, 4 * MIB as u64),
        "the peak is the 4 MiB once live, not 5 MiB of which 4 sit parked: {s:?}"
    );
    assert_eq!(free(b, d), Status::Ok);
    assert_eq!(gpupool_release_pool(d, 5), Status::Ok);
    check(d);
}
