//! The C API as a C caller sees it: status codes, messages, the stats struct ABI, bad input
//! that must change nothing, and 8+ threads hammering one device pool.
//! Runs on the host upstream, selected per device with `gpupool_configure`.

use gpupool::ffi::core::*;
use gpupool::ffi::pinned::*;
use gpupool::{Stats, Status};
use std::ffi::{c_char, c_void, CStr};
use std::ptr::null_mut;

mod common;
use common::{device_stats as stats, last_error as last};

fn host(device: i32, pool: &CStr) {
    assert_eq!(unsafe { gpupool_configure(device, pool.as_ptr(), c"host".as_ptr()) }, Status::Ok, "{}", last());
}



fn malloc(size: usize, device: i32) -> (Status, *mut c_void) {
    let mut p: *mut c_void = 1 as *mut c_void;
    let st = unsafe { gpupool_malloc(&mut p, size, device, null_mut()) };
    (st, p)
}

#[test]
fn bad_input_gets_clear_status_and_changes_nothing() {
    host(1, c"split");
    let (st, keep) = malloc(1000, 1);
    assert_eq!(st, Status::Ok);
    let before = stats(1);
    unsafe {
        assert_eq!(gpupool_malloc(null_mut(), 10, 1, null_mut()), Status::NullArgument);
        assert!(last().contains("out_ptr"), "{}", last());
        let (st, p) = malloc(0, 1);
        assert_eq!((st, p), (Status::Ok, null_mut()), "size 0 gives OK and NULL");
        assert_eq!(gpupool_free(null_mut(), 1, null_mut()), Status::Ok, "free(NULL) is a no-op");
        let (st, p) = malloc(usize::MAX, 1);
        assert_eq!((st, p), (Status::OutOfMemory, null_mut()));
        assert!(last().contains("out of memory on device 1"), "{}", last());
        // PyTorch's phrase first, which batch-size finders match, then gpupool's report.
        assert!(last().starts_with("CUDA out of memory. gpupool: out of memory on device 1"), "{}", last());
        assert_eq!(gpupool_free(keep.add(256), 1, null_mut()), Status::InvalidPointer);
        assert!(last().contains("inside the live block"), "{}", last());
        assert_eq!(gpupool_free(0x1234_5600 as *mut c_void, 1, null_mut()), Status::InvalidPointer);
        assert!(last().contains("not allocated by gpupool"), "{}", last());
        for d in [-1, 64, 1000, i32::MIN] {
            let (st, _) = malloc(10, d);
            assert_eq!(st, Status::InvalidDevice, "device {d}");
            assert!(last().contains("invalid device"));
        }
        assert_eq!(gpupool_get_stats(1, null_mut()), Status::NullArgument);
        assert_eq!(gpupool_get_limit(1, null_mut()), Status::NullArgument);
        assert_eq!(gpupool_configure(1, c"fancy".as_ptr(), null_mut()), Status::InvalidArgument);
        assert!(last().contains("split | binned | none"), "{}", last());
        assert_eq!(gpupool_configure(1, null_mut(), c"tpu".as_ptr()), Status::InvalidArgument);
        assert_eq!(gpupool_configure(1, c"binned".as_ptr(), null_mut()), Status::Busy, "live allocations block reconfiguring");
        assert_eq!(gpupool_record_stream(0x99_0000 as *mut c_void, null_mut()), Status::InvalidPointer);
    }
    let after = stats(1);
    assert_eq!((after.used_bytes, after.n_live_blocks, after.n_allocs), (before.used_bytes, before.n_live_blocks, before.n_allocs));
    assert_eq!(after.n_invalid_frees, before.n_invalid_frees + 2);
    unsafe {
        assert_eq!(gpupool_free(keep, 1, null_mut()), Status::Ok);
        assert_eq!(gpupool_free(keep, 1, null_mut()), Status::InvalidPointer);
        assert!(last().contains("double free"), "{}", last());
    }
}

#[test]
fn pointer_freed_on_the_wrong_device_is_named() {
    host(2, c"split");
    host(3, c"split");
    let (_, p) = malloc(4096, 2);
    unsafe {
        assert_eq!(gpupool_free(p, 3, null_mut()), Status::InvalidArgument);
        assert!(last().contains("allocated on device 2"), "{}", last());
        assert_eq!(gpupool_free(p, 2, null_mut()), Status::Ok);
    }
}

#[test]
fn status_strings_and_buffers() {
    for s in Status::ALL {
        let msg = unsafe { CStr::from_ptr(gpupool_status_str(s as i32)) };
        assert!(!msg.to_bytes().is_empty());
    }
    assert_eq!(Status::Ok as i32, 0);
    assert_eq!(unsafe { CStr::from_ptr(gpupool_status_str(999)) }.to_str().unwrap(), "unknown gpupool status");
    assert_eq!(unsafe { CStr::from_ptr(gpupool_status_str(-1)) }.to_str().unwrap(), "unknown gpupool status");
    host(4, c"binned");
    // snprintf convention: the return value is the full length, the buffer gets a prefix.
    let n = unsafe { gpupool_memory_status(4, null_mut(), 0) };
    assert!(n > 20);
    let mut small = [0x55u8; 8];
    let m = unsafe { gpupool_memory_status(4, small.as_mut_ptr() as *mut c_char, small.len()) };
    assert_eq!(m, n);
    assert_eq!(small[7], 0, "truncated output is NUL-terminated");
    let mut json = vec![0u8; 4096];
    unsafe { gpupool_stats_json(4, json.as_mut_ptr() as *mut c_char, json.len()) };
    let json = CStr::from_bytes_until_nul(&json).unwrap().to_str().unwrap();
    assert!(json.starts_with("{\"device\":4,\"strategy\":\"binned\",\"upstream\":\"host\""), "{json}");
}

#[test]
fn stats_struct_size_is_honoured() {
    host(5, c"split");
    // struct_size 0 means version 1's layout; a smaller size means an older header: only
    // that many bytes are written.
    let mut s = Stats::default();
    assert_eq!(unsafe { gpupool_get_stats(5, &mut s) }, Status::Ok);
    assert_eq!((s.struct_size as usize, s.version), (gpupool::stats::STATS_V1_SIZE, 1));
    #[repr(C, align(8))]
    struct Raw([u8; 256]);
    let mut raw = Raw([0xAA; 256]);
    raw.0[..4].copy_from_slice(&24u32.to_ne_bytes());
    assert_eq!(unsafe { gpupool_get_stats(5, raw.0.as_mut_ptr() as *mut Stats) }, Status::Ok);
    assert!(raw.0[24..].iter().all(|&b| b == 0xAA), "wrote past struct_size");
    // The whole struct of this header: version 2, with the peak of bytes requested.
    let mut s = Stats { struct_size: std::mem::size_of::<Stats>() as u32, ..Default::default() };
    assert_eq!(unsafe { gpupool_get_stats(5, &mut s) }, Status::Ok);
    assert_eq!((s.struct_size as usize, s.version), (gpupool::stats::STATS_V2_SIZE, 2));
}

#[test]
fn the_peak_of_bytes_requested_is_the_callers_sizes_not_the_blocks() {
    for (device, pool) in [(9, c"split"), (10, c"arena")] {
        host(device, pool);
        let (st, a) = malloc(1000, device);
        assert_eq!(st, Status::Ok);
        let (st, b) = malloc(3000, device);
        assert_eq!(st, Status::Ok);
        unsafe {
            assert_eq!(gpupool_free(a, device, null_mut()), Status::Ok);
            assert_eq!(gpupool_free(b, device, null_mut()), Status::Ok);
        }
        // A smaller allocation after the frees (which a thread cache may keep) moves nothing.
        let (st, c) = malloc(100, device);
        assert_eq!(st, Status::Ok);
        let mut s = Stats { struct_size: std::mem::size_of::<Stats>() as u32, ..Default::default() };
        assert_eq!(unsafe { gpupool_get_stats(device, &mut s) }, Status::Ok);
        assert_eq!((s.peak_requested_bytes, s.requested_bytes), (4000, 100), "{s:?}");
        assert!(s.peak_used_bytes >= 4096, "blocks are rounded: {s:?}");
        let mut json = vec![0u8; 4096];
        unsafe { gpupool_stats_json(device, json.as_mut_ptr() as *mut c_char, json.len()) };
        let json = CStr::from_bytes_until_nul(&json).unwrap().to_str().unwrap();
        assert!(json.contains("\"peak_requested_bytes\":4000"), "{json}");
        assert_eq!(unsafe { gpupool_free(c, device, null_mut()) }, Status::Ok);
    }
}

#[test]
fn limits_through_the_c_api() {
    host(6, c"split");
    unsafe {
        assert_eq!(gpupool_set_limit(6, 4 << 20), Status::Ok);
        let mut l = 0;
        assert_eq!(gpupool_get_limit(6, &mut l), Status::Ok);
        assert_eq!(l, 4 << 20);
        assert_eq!(gpupool_set_limit_str(6, c"lots".as_ptr()), Status::InvalidArgument);
        assert!(last().contains("50%"), "{}", last());
        assert_eq!(gpupool_get_limit(6, &mut l), Status::Ok);
        assert_eq!(l, 4 << 20, "a rejected limit changes nothing");
    }
    let (st, _) = malloc(5 << 20, 6);
    assert_eq!(st, Status::OutOfMemory);
    assert!(last().contains("exceed the pool limit of 4.00 MiB"), "{}", last());
    let (st, p) = malloc(3 << 20, 6);
    assert_eq!(st, Status::Ok);
    unsafe {
        gpupool_free(p, 6, null_mut());
        let mut released = 0;
        assert_eq!(gpupool_reclaim(6, &mut released), Status::Ok);
        assert_eq!(released, stats(6).reclaimed_bytes as usize);
        assert!(released >= 3 << 20);
        assert_eq!(gpupool_reclaim(-1, null_mut()), Status::Ok);
        assert_eq!(gpupool_set_limit(6, 0), Status::Ok);
    }
}

#[test]
fn no_driver_is_a_status_not_a_crash() {
    let mut n = -1;
    let st = unsafe { gpupool_device_count(&mut n) };
    if st == Status::NoDriver {
        assert!(last().contains("libcuda"), "message names what was looked for: {}", last());
        // A CUDA upstream on this machine reports the same, and the host upstream still works.
        assert_eq!(unsafe { gpupool_configure(7, null_mut(), c"device".as_ptr()) }, Status::NoDriver);
        assert_eq!(unsafe { gpupool_pinned_malloc(&mut null_mut(), 10, null_mut()) }, Status::NoDriver);
        host(7, c"split");
        assert_eq!(malloc(10, 7).0, Status::Ok);
    } else {
        // A driver is present: the call must then succeed and count devices.
        assert_eq!(st, Status::Ok, "{}", last());
        assert!(n > 0);
    }
}

#[test]
fn eight_threads_hammer_one_device_pool() {
    host(8, c"split");
    let threads = 12;
    let rounds = 4000;
    std::thread::scope(|s| {
        for t in 0..threads {
            s.spawn(move || {
                let mut mine: Vec<(*mut u8, usize, u8)> = Vec::new();
                let mut x = 0x9E37_79B9u64 ^ t as u64;
                for i in 0..rounds {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    if mine.len() > 16 || (x % 2 == 0 && !mine.is_empty()) {
                        let (p, n, tag) = mine.swap_remove(x as usize % mine.len());
                        // Another thread writing into our block would show up here.
                        let ok = unsafe { std::slice::from_raw_parts(p, n).iter().all(|&b| b == tag) };
                        assert!(ok, "thread {t}: block {p:?} overwritten");
                        assert_eq!(unsafe { gpupool_free(p as *mut c_void, 8, null_mut()) }, Status::Ok);
                    } else {
                        let n = 1 + (x as usize >> 11) % 200_000;
                        let (st, p) = malloc(n, 8);
                        assert_eq!(st, Status::Ok);
                        let tag = (t * 17 + i) as u8;
                        unsafe { std::ptr::write_bytes(p as *mut u8, tag, n) };
                        mine.push((p as *mut u8, n, tag));
                    }
                }
                for (p, _, _) in mine {
                    assert_eq!(unsafe { gpupool_free(p as *mut c_void, 8, null_mut()) }, Status::Ok);
                }
            });
        }
    });
    let s = stats(8);
    assert_eq!((s.used_bytes, s.n_live_blocks), (0, 0));
    assert_eq!(s.n_allocs, s.n_frees);
    assert_eq!(s.free_bytes, s.total_bytes);
}
