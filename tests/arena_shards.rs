//! An arena device's stream shards hold as much as its shard 0: each is an arena over ranges
//! of its own, so a stream whose shard reserved less would fail requests the device can
//! serve (the cases below ran out with most of the device free when stream shards reserved
//! less). A shard whose reservation fails runs `split`, and the device's report says so.
//! Through the C API on the host upstream (simulated devices of 256 MiB).

use gpupool::ffi::core::{gpupool_free, gpupool_malloc, gpupool_reclaim};
use gpupool::Status;
use std::ffi::{c_void, CStr};
use std::ptr::null_mut;

mod common;
use common::last_error as last;

const MIB: usize = 1 << 20;

fn host(device: i32, pool: &CStr) {
    common::host_device_256mib(device, pool);
}

fn json(device: i32) -> String {
    common::device_json(device)
}

/// A user stream's handle (`None`: the legacy stream, shard 0).
fn stream(i: Option<usize>) -> *mut c_void {
    i.map_or(null_mut(), |i| (0x7f00_0000_0000usize + i * 0x1000) as *mut c_void)
}

fn malloc(size: usize, device: i32, s: *mut c_void) -> Option<*mut c_void> {
    let mut p = null_mut();
    (unsafe { gpupool_malloc(&mut p, size, device, s) } == Status::Ok).then_some(p)
}

fn free(p: *mut c_void, device: i32, s: *mut c_void) {
    assert_eq!(unsafe { gpupool_free(p, device, s) }, Status::Ok, "{}", last());
}

fn reclaim(device: i32) {
    let mut released = 0usize;
    assert_eq!(unsafe { gpupool_reclaim(device, &mut released) }, Status::Ok, "{}", last());
}

/// Bytes of 512 KiB blocks (the small range's largest) one stream gets before running out.
fn small_blocks_held(d: i32, s: *mut c_void) -> usize {
    host(d, c"arena");
    let size = gpupool::strategy::arena::SMALL_LIMIT;
    let mut live = Vec::new();
    while let Some(p) = malloc(size, d, s) {
        live.push(p);
    }
    let n = live.len();
    live.into_iter().for_each(|p| free(p, d, s));
    n * size
}

#[test]
fn a_stream_shard_holds_as_many_small_blocks_as_shard_0() {
    let legacy = small_blocks_held(50, stream(None));
    let user = small_blocks_held(51, stream(Some(1)));
    assert!(legacy >= 192 * MIB, "shard 0 held only {} MiB of a 256 MiB device", legacy / MIB);
    assert_eq!(user, legacy, "a stream shard ran out of small blocks first");
}

/// 110 MiB and 20 MiB blocks; the first freed and its memory reclaimed; then 150 MiB (236
/// MiB of the device are free, in no contiguous mapped range).
fn large_after_a_hole(d: i32, s: *mut c_void) -> bool {
    host(d, c"arena");
    let a = malloc(110 * MIB, d, s).unwrap();
    let b = malloc(20 * MIB, d, s).unwrap();
    free(a, d, s);
    reclaim(d);
    let got = malloc(150 * MIB, d, s);
    got.into_iter().for_each(|p| free(p, d, s));
    free(b, d, s);
    got.is_some()
}

#[test]
fn a_stream_shard_serves_a_large_block_after_a_hole_as_shard_0_does() {
    assert!(large_after_a_hole(52, stream(None)), "shard 0: {}", last());
    assert!(large_after_a_hole(53, stream(Some(2))), "a stream shard: {}", last());
}

/// The device filled with 2 MiB blocks, every other one freed and reclaimed: 8 MiB must come
/// from the free half (stitched, or new memory where the holes were).
fn after_a_checkerboard(d: i32, s: *mut c_void) -> bool {
    host(d, c"arena");
    let mut live = Vec::new();
    while let Some(p) = malloc(2 * MIB, d, s) {
        live.push(p);
    }
    let mut kept = Vec::new();
    for (i, p) in live.into_iter().enumerate() {
        if i % 2 == 0 {
            free(p, d, s);
        } else {
            kept.push(p);
        }
    }
    reclaim(d);
    let got = malloc(8 * MIB, d, s);
    got.into_iter().for_each(|p| free(p, d, s));
    kept.into_iter().for_each(|p| free(p, d, s));
    got.is_some()
}

#[test]
fn a_stream_shard_serves_a_request_after_a_checkerboard_as_shard_0_does() {
    assert!(after_a_checkerboard(54, stream(None)), "shard 0: {}", last());
    assert!(after_a_checkerboard(55, stream(Some(3))), "a stream shard: {}", last());
}

#[test]
fn every_shard_reports_its_strategy() {
    let d = 56;
    host(d, c"arena");
    let (a, b) = (malloc(3 * MIB, d, stream(Some(7))).unwrap(), malloc(3 * MIB, d, stream(None)).unwrap());
    let j = json(d);
    assert!(j.contains("{\"shard\":0,\"strategy\":\"arena\"") && j.contains("\"strategy\":\"arena\",\"used_bytes\":3145728"), "{j}");
    free(a, d, stream(Some(7)));
    free(b, d, stream(None));
}

#[test]
fn a_freed_stitched_block_ends_its_export() {
    // A block whose granules are stitched (an alias range of scattered free granules) has
    // no neighbours to guard, but its export must still end when it is freed, or its
    // descriptor would map memory that serves the next block.
    use gpupool::ffi::ipc::{gpupool_ipc_close, gpupool_ipc_export, gpupool_ipc_open};
    let d = 57;
    host(d, c"arena");
    let s = stream(None);
    // Eight 2-granule blocks, every other one freed: 8 free granules, no 3 in a row, so
    // 6 granules come from a stitch rather than new memory.
    let blocks: Vec<_> = (0..8).map(|_| malloc(4 * MIB, d, s).unwrap()).collect();
    for b in blocks.iter().step_by(2) {
        free(*b, d, s);
    }
    let big = malloc(12 * MIB, d, s).unwrap();
    assert!(json(d).contains("\"stitches_made\":1"), "the test needs a stitch: {}", json(d));
    let mut len = 0usize;
    let mut desc = vec![0u8; 4096];
    assert_eq!(unsafe { gpupool_ipc_export(big, desc.as_mut_ptr().cast(), desc.len(), &mut len) }, Status::Ok, "{}", last());
    let mut p = null_mut();
    // Where pidfd_getfd is refused (a sandbox) the import asks the exporter's handover
    // thread instead: a live export opens either way.
    let opened = unsafe { gpupool_ipc_open(desc.as_ptr().cast(), len, d, null_mut(), 0, &mut p) };
    assert_eq!(opened, Status::Ok, "a live export was refused: {}", last());
    assert_eq!(gpupool_ipc_close(p, d), Status::Ok, "{}", last());
    free(big, d, s);
    let again = unsafe { gpupool_ipc_open(desc.as_ptr().cast(), len, d, null_mut(), 0, &mut p) };
    assert_eq!(again, Status::InvalidArgument, "a freed block's descriptor was opened");
    assert!(last().contains("no longer exports"), "{}", last());
    blocks.iter().skip(1).step_by(2).for_each(|b| free(*b, d, s));
}
