//! A device's pool in shards (`src/registry`): user streams allocate from shards of their
//! own, frees find the shard that holds the block, the limit and the memory capacity are
//! the device's, a shard out of memory gets the others' cache back, and the reports add
//! the shards up. Through the C API on the host upstream (a simulated device of 256 MiB
//! that every shard of a device draws on), each test on a device of its own.

use gpupool::ffi::core::*;
use gpupool::Status;
use std::ffi::{c_char, c_void, CStr};
use std::ptr::null_mut;

mod common;
use common::{device_stats as stats, last_error as last};

const MIB: usize = 1 << 20;

fn host(device: i32, pool: &CStr) {
    common::host_device_256mib(device, pool);
}

fn json(device: i32) -> String {
    common::device_json(device)
}

fn status(device: i32) -> String {
    let n = unsafe { gpupool_memory_status(device, null_mut(), 0) };
    let mut buf = vec![0u8; n + 1];
    unsafe { gpupool_memory_status(device, buf.as_mut_ptr() as *mut c_char, buf.len()) };
    CStr::from_bytes_until_nul(&buf).unwrap().to_str().unwrap().to_string()
}

/// A fake user stream handle (the host upstream takes any non-legacy handle as a stream).
fn stream(i: usize) -> *mut c_void {
    (0x7f00_0000_0000usize + i * 0x1000) as *mut c_void
}

fn malloc(size: usize, device: i32, s: *mut c_void) -> *mut c_void {
    let mut p = null_mut();
    assert_eq!(unsafe { gpupool_malloc(&mut p, size, device, s) }, Status::Ok, "{}", last());
    p
}

fn free(p: *mut c_void, device: i32, s: *mut c_void) -> Status {
    unsafe { gpupool_free(p, device, s) }
}

/// How many shards the JSON report lists (0: the device is one pool).
fn shard_count(device: i32) -> usize {
    json(device).matches("{\"shard\":").count()
}

#[test]
fn each_user_stream_gets_a_shard_and_frees_find_it_from_any_stream() {
    let d = 40;
    host(d, c"split");
    let a = malloc(3000, d, stream(1));
    let b = malloc(3000, d, stream(2));
    let c = malloc(3000, d, null_mut());
    assert_eq!(shard_count(d), 3, "shard 0 and one per stream: {}", json(d));
    let s = stats(d);
    assert_eq!((s.n_live_blocks, s.n_allocs), (3, 3));
    assert_eq!(s.requested_bytes, 9000);
    // A block freed on another stream than its own, and one freed on the legacy stream:
    // each goes back to the shard that holds it.
    assert_eq!(free(a, d, stream(2)), Status::Ok, "{}", last());
    assert_eq!(free(b, d, null_mut()), Status::Ok, "{}", last());
    assert_eq!(free(c, d, stream(1)), Status::Ok, "{}", last());
    // Double frees are caught whichever stream names them.
    for s in [stream(1), stream(2), null_mut(), stream(9)] {
        assert_eq!(free(a, d, s), Status::InvalidPointer);
        assert!(last().contains("double free") || last().contains("already freed"), "{}", last());
    }
    let s = stats(d);
    assert_eq!((s.n_live_blocks, s.used_bytes, s.n_frees), (0, 0, 3));
    assert_eq!(s.n_invalid_frees, 4);
    // record_stream and reclaim reach every shard.
    let e = malloc(5 * MIB, d, stream(3));
    assert_eq!(unsafe { gpupool_record_stream(e, stream(1)) }, Status::Ok, "{}", last());
    assert_eq!(free(e, d, stream(3)), Status::Ok);
    let mut released = 0;
    assert_eq!(unsafe { gpupool_reclaim(d, &mut released) }, Status::Ok);
    assert!(released > 0);
    assert_eq!(stats(d).total_bytes, 0, "{}", status(d));
}

#[test]
fn a_free_naming_the_wrong_device_says_which_device_has_it() {
    host(41, c"split");
    host(42, c"split");
    let p = malloc(1000, 41, stream(5));
    assert_eq!(free(p, 42, stream(5)), Status::InvalidArgument);
    assert!(last().contains("allocated on device 41"), "{}", last());
    assert_eq!(free(p, 41, stream(5)), Status::Ok);
}

#[test]
fn the_limit_caps_the_device_not_each_shard() {
    let d = 43;
    host(d, c"split");
    assert_eq!(gpupool_set_limit(d, 64 * MIB), Status::Ok);
    let mut live = Vec::new();
    // 20 MiB blocks on eight streams: at most three fit under 64 MiB, whichever shards ask.
    for i in 0..8 {
        let mut p = null_mut();
        match unsafe { gpupool_malloc(&mut p, 20 * MIB, d, stream(10 + i)) } {
            Status::Ok => live.push((p, stream(10 + i))),
            Status::OutOfMemory => assert!(last().contains("limit"), "{}", last()),
            st => panic!("{st:?}: {}", last()),
        }
    }
    let s = stats(d);
    assert_eq!(live.len(), 3, "{}", status(d));
    assert!(s.total_bytes <= 64 * MIB as u64 && s.peak_total_bytes <= 64 * MIB as u64, "{}", status(d));
    assert_eq!(s.limit_bytes, 64 * MIB as u64);
    for (p, s) in live {
        assert_eq!(free(p, d, s), Status::Ok);
    }
    // Lowering the limit releases cache in every shard.
    assert_eq!(gpupool_set_limit(d, 0), Status::Ok);
    assert_eq!(gpupool_set_limit(d, 1), Status::Ok);
    assert_eq!(stats(d).total_bytes, 0, "{}", status(d));
    assert_eq!(gpupool_set_limit(d, 0), Status::Ok);
}

#[test]
fn memory_cached_on_one_stream_serves_another_when_the_device_runs_out() {
    let d = 44;
    host(d, c"split");
    // 200 of the device's 256 MiB, allocated and freed on stream A: cached in A's shard.
    let a = malloc(200 * MIB, d, stream(20));
    assert_eq!(free(a, d, stream(20)), Status::Ok);
    assert!(stats(d).total_bytes >= 200 * MIB as u64);
    // Stream B needs 200 MiB too: only A's cache can give it.
    let b = malloc(200 * MIB, d, stream(21));
    let s = stats(d);
    assert_eq!(s.n_ooms, 0, "the retry succeeded, so no out-of-memory is counted: {}", status(d));
    assert!(s.total_bytes <= 256 * MIB as u64);
    assert_eq!(free(b, d, stream(21)), Status::Ok);
    // And the legacy stream (shard 0) gets B's cache the same way.
    let c = malloc(200 * MIB, d, null_mut());
    assert_eq!(free(c, d, null_mut()), Status::Ok);
    assert_eq!(stats(d).n_ooms, 0);
    // A request no shard's cache can serve is still out of memory, counted once.
    let mut p = null_mut();
    assert_eq!(unsafe { gpupool_malloc(&mut p, 300 * MIB, d, stream(22)) }, Status::OutOfMemory);
    assert_eq!(stats(d).n_ooms, 1);
}

#[test]
fn reports_add_the_shards_up() {
    let d = 45;
    host(d, c"split");
    let a = malloc(MIB, d, stream(30));
    let b = malloc(3 * MIB, d, stream(31));
    let s = stats(d);
    assert_eq!(s.used_bytes, 4 * MIB as u64);
    assert!(s.peak_used_bytes >= 4 * MIB as u64);
    assert_eq!(s.peak_requested_bytes, 4 * MIB as u64, "the shards' peaks of bytes requested, added up");
    assert_eq!(s.used_bytes + s.free_bytes, s.total_bytes);
    let text = status(d);
    assert!(text.contains("Stream shards: 3 in use"), "{text}");
    assert!(text.contains("gpupool device 45 (split pool on host upstream)"), "{text}");
    let j = json(d);
    assert!(j.contains("\"used_bytes\":4194304") && j.contains("\"driver_calls\""), "{j}");
    for (shard, bytes) in [(1, MIB), (2, 3 * MIB)] {
        let entry = format!("\"peak_used_bytes\":{bytes},\"peak_requested_bytes\":{bytes},");
        assert!(j.contains(&entry), "shard {shard}'s own peaks in the shards list: {j}");
    }
    let n = unsafe { gpupool_snapshot_json(d, null_mut(), 0) };
    let mut buf = vec![0u8; n + 1];
    unsafe { gpupool_snapshot_json(d, buf.as_mut_ptr() as *mut c_char, buf.len()) };
    let snap = CStr::from_bytes_until_nul(&buf).unwrap().to_str().unwrap().to_string();
    for p in [a, b] {
        assert!(snap.contains(&format!("\"address\":{},\"size\"", p as usize)), "block {p:?} missing from {snap}");
    }
    assert_eq!(free(a, d, stream(30)), Status::Ok);
    assert_eq!(free(b, d, stream(31)), Status::Ok);
}

#[test]
fn the_arena_shards_by_stream_and_reports_every_shard() {
    let d = 46;
    host(d, c"arena");
    let a = malloc(MIB / 2, d, stream(40));
    let b = malloc(3 * MIB, d, stream(41));
    let j = json(d);
    assert_eq!(shard_count(d), 3, "shard 0 and one per stream: {j}");
    // Each stream's shard is an arena of its own; the device's `arena` object adds them up:
    // one granule of the small range and two of the large one.
    assert!(j.contains("\"strategy\":\"arena\""), "{j}");
    assert!(j.contains("\"granules_mapped\":3,"), "{j}");
    assert!(j.contains(&format!("\"mapped_bytes\":{}", 6 * MIB)), "{j}");
    let text = status(d);
    assert!(text.contains("Arena: 6.00 MiB mapped in 3 granules"), "{text}");
    assert_eq!(free(a, d, stream(40)), Status::Ok);
    assert_eq!(free(b, d, stream(41)), Status::Ok);
    // Reconfigured to split, the same device shards again.
    host(d, c"split");
    let a = malloc(MIB, d, stream(40));
    assert_eq!(shard_count(d), 2, "{}", json(d));
    assert_eq!(free(a, d, stream(40)), Status::Ok);
}

#[test]
fn threads_on_their_own_streams_churn_without_losing_a_byte() {
    churn_on_own_streams(47, c"split");
}

#[test]
fn arena_threads_on_their_own_streams_churn_without_losing_a_byte() {
    churn_on_own_streams(51, c"arena");
    assert!(json(51).contains("\"strategy\":\"arena\""), "{}", json(51));
}

/// Eight threads, each on its own stream, churn blocks of random sizes, checking that no
/// block was handed out twice (each carries its owner's stamp); at the end nothing is live
/// and each stream had a shard of its own.
fn churn_on_own_streams(d: i32, pool: &CStr) {
    host(d, pool);
    let threads: Vec<_> = (0..8)
        .map(|t| {
            std::thread::spawn(move || {
                let s = stream(50 + t);
                let mut slots: Vec<(usize, usize)> = vec![(0, 0); 16];
                let mut x = 0x9E37_79B9u64 + t as u64;
                for i in 0..20_000u64 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let k = (x % 16) as usize;
                    let (p, n) = slots[k];
                    if p != 0 {
                        // SAFETY: our live block of n bytes, stamped with its first byte below.
                        assert_eq!(unsafe { *(p as *const u8) }, (p >> 8) as u8 ^ t as u8, "block {p:#x} overwritten");
                        assert_eq!(free(p as *mut c_void, d, s), Status::Ok, "{}", last());
                    }
                    let n2 = 256 + (x >> 20) as usize % (n + 64 * 1024);
                    let q = malloc(n2, d, s) as usize;
                    // SAFETY: a fresh block of n2 >= 256 bytes of host memory.
                    unsafe { *(q as *mut u8) = (q >> 8) as u8 ^ t as u8 };
                    slots[k] = (q, n2);
                    if i % 5000 == 0 {
                        std::thread::yield_now();
                    }
                }
                for (p, _) in slots {
                    if p != 0 {
                        assert_eq!(free(p as *mut c_void, d, s), Status::Ok);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let s = stats(d);
    assert_eq!((s.n_live_blocks, s.used_bytes, s.n_invalid_frees), (0, 0, 0), "{}", status(d));
    assert_eq!(s.n_allocs, s.n_frees);
    assert_eq!(shard_count(d), 9, "shard 0 and eight streams, one each: {}", json(d));
}

#[test]
fn a_thread_that_remembers_its_streams_shard_follows_a_reconfigured_device() {
    // The front end remembers the shard of its thread's last stream (`thread_cache::shard_for`);
    // a device remade with another shard count must not get allocations on a shard that no
    // longer exists. Same thread, same stream throughout.
    let d = 48;
    let s = stream(60);
    host(d, c"split");
    for _ in 0..3 {
        let p = malloc(MIB, d, s);
        assert_eq!(free(p, d, s), Status::Ok);
    }
    assert_eq!(shard_count(d), 2, "{}", json(d));
    let p = malloc(MIB, d, s);
    assert_eq!(free(p, d, s), Status::Ok);
    host(d, c"arena");
    let p = malloc(MIB, d, s);
    assert_eq!(shard_count(d), 2, "the arena shards by stream too: {}", json(d));
    assert!(json(d).contains("\"arena\""), "{}", json(d));
    assert_eq!(stats(d).n_live_blocks, 1, "{}", status(d));
    assert_eq!(free(p, d, s), Status::Ok);
    host(d, c"split");
    let p = malloc(MIB, d, s);
    assert_eq!(shard_count(d), 2, "{}", json(d));
    assert_eq!(stats(d).n_live_blocks, 1, "{}", status(d));
    assert_eq!(free(p, d, s), Status::Ok);
}

#[test]
fn two_working_streams_dealt_one_shard_end_on_two() {
    // A stream handle recycled from a destroyed stream, or the round-robin turn gone round,
    // can put two live streams on one shard; threads allocating on both (sizes their thread
    // caches miss) must end up on different shards (`registry/streams.rs`), and no byte
    // is lost on the way. The threads pause between allocations, so they seldom find the
    // lock taken: the sign of sharing must be the other stream's allocations, not the lock.
    let d = 49;
    host(d, c"split");
    // Sixteen streams take shards 1..=16 (the default count) in turn; the next one shares
    // shard 1 with the first.
    for i in 0..16 {
        let p = malloc(4096, d, stream(60 + i));
        assert_eq!(free(p, d, stream(60 + i)), Status::Ok);
    }
    let (a, b) = (stream(60) as usize, stream(76) as usize);
    let workers: Vec<_> = [a, b]
        .into_iter()
        .map(|s| {
            std::thread::spawn(move || {
                let s = s as *mut c_void;
                let mut x = 0x2545_F491u64 ^ s as u64;
                let t0 = std::time::Instant::now();
                let mut held = Vec::new();
                while t0.elapsed() < std::time::Duration::from_millis(300) {
                    std::thread::sleep(std::time::Duration::from_micros(50));
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    held.push(malloc(512 + (x % 4096) as usize * 64, d, s) as usize);
                    if held.len() > 8 {
                        let p = held.swap_remove((x >> 32) as usize % held.len());
                        assert_eq!(free(p as *mut c_void, d, s), Status::Ok, "{}", last());
                    }
                }
                // One block each stays live: the report shows which shard holds it.
                for p in held.drain(1..) {
                    assert_eq!(free(p as *mut c_void, d, s), Status::Ok, "{}", last());
                }
                held[0]
            })
        })
        .collect();
    let live: Vec<usize> = workers.into_iter().map(|w| w.join().unwrap()).collect();
    let j = json(d);
    let holding = j.split("{\"shard\":").skip(1).filter(|part| !part.contains("\"used_bytes\":0,")).count();
    assert_eq!(holding, 2, "the two streams' last blocks are on one shard: {j}");
    for (p, s) in live.into_iter().zip([a, b]) {
        assert_eq!(free(p as *mut c_void, d, s as *mut c_void), Status::Ok);
    }
    let s = stats(d);
    assert_eq!((s.n_live_blocks, s.used_bytes, s.n_invalid_frees), (0, 0, 0), "{}", status(d));
}

#[test]
fn a_request_no_release_could_help_leaves_the_other_shards_caches() {
    let d = 49;
    host(d, c"arena");
    // 100 MiB cached in stream A's shard.
    let a = malloc(100 * MIB, d, stream(30));
    assert_eq!(free(a, d, stream(30)), Status::Ok);
    let cached = stats(d).total_bytes;
    assert!(cached >= 100 * MIB as u64);
    // 300 MiB on this 256 MiB device: out of memory at once, A's cache untouched.
    let mut p = null_mut();
    assert_eq!(unsafe { gpupool_malloc(&mut p, 300 * MIB, d, stream(31)) }, Status::OutOfMemory);
    assert_eq!(stats(d).total_bytes, cached, "a hopeless request emptied another shard's cache: {}", status(d));
    assert_eq!(stats(d).n_ooms, 1);
    // A request the cache can serve still gets it from A's shard.
    let b = malloc(200 * MIB, d, stream(31));
    assert_eq!(free(b, d, stream(31)), Status::Ok);
}

#[test]
fn a_peak_reset_reaches_every_shard_and_the_devices_reserved_peak() {
    let d = 58;
    host(d, c"split");
    let a = malloc(40 * MIB, d, stream(1));
    let b = malloc(3000, d, stream(2));
    assert_eq!(free(a, d, stream(1)), Status::Ok);
    assert_eq!(unsafe { gpupool_reclaim(d, null_mut()) }, Status::Ok, "{}", last());
    let high = stats(d);
    assert!(shard_count(d) >= 2, "{}", json(d));
    assert!(high.peak_total_bytes > high.total_bytes && high.peak_used_bytes > high.used_bytes, "{high:?}");
    assert_eq!(gpupool_reset_peak_stats(d), Status::Ok, "{}", last());
    let low = stats(d);
    assert_eq!(low.peak_total_bytes, low.total_bytes, "{low:?}");
    assert_eq!(low.peak_used_bytes, low.used_bytes, "{low:?}");
    assert_eq!(low.peak_requested_bytes, low.requested_bytes, "{low:?}");
    assert_eq!(free(b, d, stream(2)), Status::Ok);
}
