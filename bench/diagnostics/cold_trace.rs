//! A `GPUPOOL_TRACE`'s allocations and frees through the C API on the host upstream, with a
//! buffer touched between operations (as a PyTorch program's Python and kernel launches
//! touch their own data between two allocator calls): what each pool costs per operation
//! on a real program's sequence when its books are cold, and what the touching itself
//! costs (what the pool's books evict of the program's data). The trace is replayed twice;
//! the first pass (which grows the pool, as a program's first steps do) is untimed, and
//! what it left live is freed before the second, timed one.
//! `cargo run --release --example cold_trace -- TRACE.csv[.xz] [POOL] [THRASH_KIB]`
//! (an `.xz` trace is read through `xz -dc`).
use gpupool::error::Status;
use gpupool::ffi::core::{gpupool_configure, gpupool_free, gpupool_malloc};
use gpupool::replay::parse;
use gpupool::trace::Action;
use std::collections::HashMap;
use std::ffi::c_void;
use std::ptr::null_mut;
use std::time::{Duration, Instant};

fn main() {
    let path = std::env::args().nth(1).expect("usage: cold_trace TRACE.csv[.xz] [POOL] [THRASH_KIB]");
    let pool = std::env::args().nth(2).unwrap_or("arena".into());
    let thrash_kib: usize = std::env::args().nth(3).and_then(|s| s.parse().ok()).unwrap_or(4096);
    let text = if path.ends_with(".xz") {
        let out = std::process::Command::new("xz").args(["-dc", &path]).output().expect("xz runs");
        assert!(out.status.success(), "xz -dc {path}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).expect("a UTF-8 trace")
    } else {
        std::fs::read_to_string(&path).expect("readable trace")
    };
    let ops: Vec<_> = parse(&text).expect("a trace").into_iter().filter(|o| matches!(o.action, Action::Alloc | Action::Free)).collect();
    let cpool = std::ffi::CString::new(pool.clone()).unwrap();
    let status = unsafe { gpupool_configure(0, cpool.as_ptr(), c"host".as_ptr()) };
    assert!(status == Status::Ok, "gpupool_configure({pool}, host): {status:?}");
    let mut junk = vec![1u8; thrash_kib << 10];
    let mut sum = 0u64;
    let mut work = Duration::ZERO;
    // A failed allocation (the trace's peak over the host upstream's memory) would time a
    // refusal, not the pool's work: counted, and the figure refused.
    let mut failed = 0u64;
    let mut pass = |timed: bool| {
        let (mut live, mut busy, mut n) = (HashMap::<(i32, usize), (*mut c_void, usize)>::new(), Duration::ZERO, 0u64);
        for (i, op) in ops.iter().enumerate() {
            if op.action == Action::Free && !live.contains_key(&(op.device, op.ptr)) {
                continue; // freed before the trace began
            }
            if timed {
                let t = Instant::now();
                for j in (0..junk.len()).step_by(64) {
                    junk[j] = junk[j].wrapping_add(i as u8);
                    sum += junk[j] as u64;
                }
                work += t.elapsed();
            }
            let t = Instant::now();
            match op.action {
                Action::Alloc => {
                    let mut p = null_mut();
                    if unsafe { gpupool_malloc(&mut p, op.size, 0, op.stream as *mut c_void) } != Status::Ok {
                        failed += 1;
                    }
                    live.insert((op.device, op.ptr), (p, op.stream));
                }
                _ => {
                    let (p, _) = live.remove(&(op.device, op.ptr)).expect("checked above");
                    unsafe { gpupool_free(p, 0, op.stream as *mut c_void) };
                }
            }
            busy += t.elapsed();
            n += 1;
        }
        for (_, (p, stream)) in live {
            unsafe { gpupool_free(p, 0, stream as *mut c_void) };
        }
        (busy, n)
    };
    pass(false);
    let (busy, n) = pass(true);
    assert_eq!(failed, 0, "{failed} allocations failed (the trace needs more than the host upstream holds)");
    // The touching's own time shows what the pool's books evict of the program's data.
    println!(
        "{pool}: {:.0} ns per operation over {n} with {thrash_kib} KiB touched between them, the touching {:.0} ns (checksum {})",
        busy.as_nanos() as f64 / n as f64,
        work.as_nanos() as f64 / n as f64,
        sum % 7
    );
}
