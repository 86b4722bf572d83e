//! A stream shard whose arena cannot reserve its address space runs `split`, and the
//! device's report says which shard and why (shard 0's own notice is in its extras). A
//! process of its own: `GPUPOOL_ARENA_VA` is read once per process.

use gpupool::ffi::core::{gpupool_configure, gpupool_free, gpupool_malloc, gpupool_stats_json};
use gpupool::Status;
use std::ffi::{c_char, c_void, CStr};
use std::ptr::null_mut;

mod common;
use common::last_error as last;

const MIB: usize = 1 << 20;

#[test]
fn a_stream_shard_that_falls_back_to_split_is_reported() {
    // 30 TiB of large range per shard (and as much for stitches): shard 0 and the first
    // stream shard fit in the process's address space, later shards do not.
    std::env::set_var("GPUPOOL_HOST_CAPACITY", "256MiB");
    std::env::set_var("GPUPOOL_ARENA_VA", "30TiB");
    let d = 0;
    assert_eq!(unsafe { gpupool_configure(d, c"arena".as_ptr(), c"host".as_ptr()) }, Status::Ok, "{}", last());
    let streams: Vec<*mut c_void> = (1..=3).map(|i| (0x7f00_0000_0000usize + i * 0x1000) as *mut c_void).collect();
    let mut blocks = Vec::new();
    for &s in &streams {
        let mut p = null_mut();
        assert_eq!(unsafe { gpupool_malloc(&mut p, 3 * MIB, d, s) }, Status::Ok, "{}", last());
        blocks.push((p, s));
    }
    let n = unsafe { gpupool_stats_json(d, null_mut(), 0) };
    let mut buf = vec![0u8; n + 1];
    unsafe { gpupool_stats_json(d, buf.as_mut_ptr() as *mut c_char, buf.len()) };
    let j = CStr::from_bytes_until_nul(&buf).unwrap().to_str().unwrap().to_string();
    for (p, s) in blocks {
        assert_eq!(unsafe { gpupool_free(p, d, s) }, Status::Ok);
    }
    assert!(j.contains("\"strategy\":\"split\""), "no shard fell back (the test needs one): {j}");
    assert!(j.contains("\"shard_notices\":[\"shard ") && j.contains("using split"), "the fallback is not reported: {j}");
}
