//! `bench/gpu/threads_bench.c`'s workloads through the C API over the host upstream: how the
//! library alone scales with threads and streams, with no driver in the way (on the GPU
//! host, beside threads_bench, this separates the pool's own scaling from the driver's).
//!
//! `cargo run --release --example threads_host [PAIRS_PER_THREAD]` (default 200000);
//! `THREADS_HOST_WORKLOAD=pairs|churn|serving` and `THREADS_HOST_STREAMS=legacy|own` keep only those rows;
//! `THREADS_HOST_POOL=arena` (default split) picks the pool; `THREADS_HOST_CALLS=1` prints
//! the driver calls (those a CUDA upstream would make) after each row.
//! Workloads as in threads_bench: 1 MiB pairs, churn (64 slots, 512 B..4 MiB log-uniform,
//! free then allocate), serving (32 requests per thread, buffers growing by 64 KiB a token,
//! the longer one allocated before the old one is freed). Each thread first runs its
//! workload untimed for as many pairs as it times; the window runs from the first thread's
//! start to the last thread's end. A stream here is any handle value (the host upstream
//! has no driver); "legacy" is the null stream for every thread.
//!
//! Clock, as in threads_bench: between warm-up and timed work every thread of a row runs a
//! pure-ALU loop at once; the last column scales "x one thread" by the row's median loop
//! time over the one-thread row's (the machine's cores run slower when all are busy).

use gpupool::ffi::core::{gpupool_configure, gpupool_free, gpupool_malloc};
use std::ffi::c_void;
use std::ptr::null_mut;
use std::sync::Barrier;
use std::time::Instant;

#[derive(Copy, Clone, PartialEq)]
enum Workload {
    Pairs,
    Churn,
    Serving,
}

const SLOTS: usize = 64;
const REQUESTS: usize = 32;
const TOKEN: usize = 64 << 10;

fn alloc(n: usize, stream: usize) -> usize {
    let mut p: *mut c_void = null_mut();
    // SAFETY: `p` is a valid out pointer.
    let st = unsafe { gpupool_malloc(&mut p, n, 0, stream as *mut c_void) };
    assert_eq!(st as i32, 0, "allocation of {n} bytes failed");
    p as usize
}

fn free(p: usize, stream: usize) {
    if p != 0 {
        // SAFETY: `p` came from `alloc` on device 0.
        let st = unsafe { gpupool_free(p as *mut c_void, 0, stream as *mut c_void) };
        assert_eq!(st as i32, 0, "free of {p:#x} failed");
    }
}

/// ns per 1,000 iterations of a dependent xorshift chain: the core's clock, nothing else.
fn clock_ref() -> f64 {
    const ITERS: u64 = 1 << 21;
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    let t = Instant::now();
    for _ in 0..ITERS {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
    }
    let ns = t.elapsed().as_nanos() as f64;
    std::hint::black_box(x);
    ns * 1000.0 / ITERS as f64
}

/// One thread's work: `pairs` untimed, the clock loop (every thread of the row at once),
/// then `pairs` timed between the barrier and the return. Returns the timed window (start,
/// end) in ns since `epoch` and the clock loop's ns per 1,000 iterations.
fn worker(wl: Workload, stream: usize, pairs: usize, start: &Barrier, epoch: Instant) -> (f64, f64, f64) {
    let mut slots = [0usize; SLOTS];
    let mut sizes = [0usize; SLOTS];
    let mut lengths = [0usize; SLOTS];
    let mut rng: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut step = |rng: &mut u64| match wl {
        Workload::Pairs => {
            let p = alloc(1 << 20, stream);
            free(p, stream);
        }
        Workload::Churn => {
            *rng ^= *rng << 13;
            *rng ^= *rng >> 7;
            *rng ^= *rng << 17;
            let slot = (*rng % SLOTS as u64) as usize;
            let n = (512.0 * (((*rng >> 20) % 100_000) as f64 / 100_000.0 * 8192f64.ln()).exp()) as usize;
            free(slots[slot], stream);
            slots[slot] = alloc(n, stream);
            sizes[slot] = n;
        }
        Workload::Serving => {
            *rng ^= *rng << 13;
            *rng ^= *rng >> 7;
            *rng ^= *rng << 17;
            let r = (*rng % REQUESTS as u64) as usize;
            let mut n = sizes[r] + TOKEN;
            if sizes[r] == 0 || sizes[r] >= lengths[r] {
                n = TOKEN;
                lengths[r] = (256 << 10) + ((*rng >> 24) % 32) as usize * (256 << 10);
            }
            let p = alloc(n, stream);
            free(slots[r], stream);
            slots[r] = p;
            sizes[r] = n;
        }
    };
    for _ in 0..pairs {
        step(&mut rng);
    }
    start.wait();
    let clock = clock_ref();
    start.wait();
    let t0 = epoch.elapsed().as_nanos() as f64;
    for _ in 0..pairs {
        step(&mut rng);
    }
    let t1 = epoch.elapsed().as_nanos() as f64;
    for p in slots {
        free(p, stream);
    }
    (t0, t1, clock)
}

fn main() {
    let pairs: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(200_000);
    // THREADS_HOST_POOL picks the pool (default split, as threads_bench's "gpupool" rows).
    let pool = std::ffi::CString::new(std::env::var("THREADS_HOST_POOL").unwrap_or_else(|_| "split".into())).expect("no NUL");
    // SAFETY: NUL-terminated strings.
    let st = unsafe { gpupool_configure(0, pool.as_ptr(), c"host".as_ptr()) };
    assert_eq!(st as i32, 0, "gpupool_configure failed");
    println!("| workload | streams | threads | M pairs/s | clock ns/1k | x one thread | x one thread, equal clock |\n|---|---|---|---|---|---|---|");
    let mut round = 0usize;
    // As threads_bench's THREADS_BENCH_WORKLOAD / _STREAMS: only the rows named.
    let wl_only = std::env::var("THREADS_HOST_WORKLOAD").ok();
    let streams_only = std::env::var("THREADS_HOST_STREAMS").ok();
    for wl in [Workload::Pairs, Workload::Churn, Workload::Serving] {
        let wl_name = ["pairs", "churn", "serving"][wl as usize];
        for own in [false, true] {
            if wl_only.as_deref().is_some_and(|w| w != wl_name) || streams_only.as_deref().is_some_and(|s| s != ["legacy", "own"][own as usize]) {
                continue;
            }
            let (mut one, mut one_clock) = (0.0, 0.0);
            for threads in [1usize, 4, 16] {
                round += 1;
                let start = Barrier::new(threads);
                let epoch = Instant::now();
                let windows: Vec<(f64, f64, f64)> = std::thread::scope(|s| {
                    let hs: Vec<_> = (0..threads)
                        .map(|i| {
                            // Distinct handles per row, as threads_bench's fresh streams are.
                            let stream = if own { 0x10_0000 * round + 0x100 * (i + 1) } else { 0 };
                            let start = &start;
                            s.spawn(move || worker(wl, stream, pairs, start, epoch))
                        })
                        .collect();
                    hs.into_iter().map(|h| h.join().expect("worker panicked")).collect()
                });
                if std::env::var_os("THREADS_HOST_CALLS").is_some() {
                    let mut buf = vec![0u8; 1 << 16];
                    // SAFETY: `buf` has the length passed.
                    let n = unsafe { gpupool::ffi::core::gpupool_stats_json(0, buf.as_mut_ptr().cast(), buf.len()) };
                    let j = String::from_utf8_lossy(&buf[..n.min(buf.len() - 1)]).to_string();
                    if let Some(at) = j.find("\"driver_calls\"") {
                        eprintln!("after row {round}: {}", &j[at..at + j[at..].find('}').unwrap_or(0) + 1]);
                    }
                }
                let first = windows.iter().map(|w| w.0).fold(f64::MAX, f64::min);
                let last = windows.iter().map(|w| w.1).fold(0.0, f64::max);
                let rate = (threads * pairs) as f64 / (last - first) * 1e3;
                let mut clocks: Vec<f64> = windows.iter().map(|w| w.2).collect();
                clocks.sort_by(f64::total_cmp);
                let clock = clocks[threads / 2];
                if threads == 1 {
                    one = rate;
                    one_clock = clock;
                }
                let name = match wl {
                    Workload::Pairs => "1 MiB pairs",
                    Workload::Churn => "churn",
                    Workload::Serving => "serving",
                };
                println!(
                    "| {name} | {} | {threads} | {rate:.2} | {clock:.0} | {:.1} | {:.1} |",
                    if own { "own stream" } else { "legacy" },
                    rate / one,
                    rate / one * clock / one_clock
                );
            }
        }
    }
}
