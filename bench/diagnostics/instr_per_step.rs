//! Steps for counting instructions per allocator operation under callgrind (deterministic,
//! unlike wall time on a shared machine):
//!
//! ```text
//! cargo build --release --example instr_per_step
//! for n in 100000 200000; do
//!   [GPUPOOL_THREAD_CACHE=0] valgrind --tool=callgrind --callgrind-out-file=/dev/null \
//!     target/release/examples/instr_per_step MODE $n 2>&1 | grep Collected
//! done
//! ```
//! `GPUPOOL_POOL=arena` measures the arena instead of `split`.
//! Instructions per step = (count at 200000 - count at 100000) / 100000, which cancels the
//! set-up. MODE: `pair` / `cupypair` (a cached 1 MiB malloc + free through the C API /
//! CuPy's entry points), `streampair` (`pair` on a user stream), `churn` / `cupychurn` /
//! `streamchurn` (the `c_api/churn_step` bench's sequence:
//! free a random one of 256 slots, allocate a log-uniform size in [512 B, 32 MiB]). Runs on
//! the host upstream; no GPU needed.

use gpupool::ffi::core::{gpupool_configure, gpupool_free, gpupool_malloc};
use gpupool::ffi::cupy::{gpupool_cupy_free, gpupool_cupy_malloc};
use std::ffi::c_void;
use std::ptr::null_mut;

#[path = "../criterion/common/churn_sequence.rs"]
mod churn_sequence;
use churn_sequence::churn_sequence;

fn main() {
    let mut args = std::env::args().skip(1);
    let usage = "usage: instr_per_step pair|streampair|cupypair|churn|streamchurn|cupychurn STEPS";
    let mode = args.next().expect(usage);
    let steps: usize = args.next().and_then(|s| s.parse().ok()).expect(usage);
    const DEVICE: i32 = 0;
    // A user stream for the `stream*` modes: any handle value (the host upstream has no driver).
    const STREAM: *mut c_void = 0x1000 as *mut c_void;
    // GPUPOOL_POOL picks the strategy measured (split by default).
    let pool = std::ffi::CString::new(std::env::var("GPUPOOL_POOL").unwrap_or_else(|_| "split".into())).expect("a pool name");
    assert_eq!(unsafe { gpupool_configure(DEVICE, pool.as_ptr(), c"host".as_ptr()) }, gpupool::Status::Ok);
    let seq = churn_sequence(1 << 16);
    let mut slots = [null_mut::<c_void>(); 256];
    for i in 0..steps {
        let (slot, size) = seq[i % seq.len()];
        unsafe {
            match mode.as_str() {
                "pair" => {
                    let mut p = null_mut();
                    gpupool_malloc(&mut p, 1 << 20, DEVICE, null_mut());
                    gpupool_free(p, DEVICE, null_mut());
                }
                "streampair" => {
                    let mut p = null_mut();
                    gpupool_malloc(&mut p, 1 << 20, DEVICE, STREAM);
                    gpupool_free(p, DEVICE, STREAM);
                }
                "streamchurn" => {
                    gpupool_free(slots[slot], DEVICE, STREAM);
                    gpupool_malloc(&mut slots[slot], size, DEVICE, STREAM);
                }
                "cupypair" => {
                    let p = gpupool_cupy_malloc(null_mut(), 1 << 20, DEVICE);
                    gpupool_cupy_free(null_mut(), p, DEVICE);
                }
                "churn" => {
                    gpupool_free(slots[slot], DEVICE, null_mut());
                    gpupool_malloc(&mut slots[slot], size, DEVICE, null_mut());
                }
                "cupychurn" => {
                    if !slots[slot].is_null() {
                        gpupool_cupy_free(null_mut(), slots[slot], DEVICE);
                    }
                    slots[slot] = gpupool_cupy_malloc(null_mut(), size, DEVICE);
                }
                _ => panic!("{usage}"),
            }
        }
    }
}
