//! Speed of a cached malloc + free pair.
//!
//! - `c_api/*`: through the exported C functions on the host upstream (the hot path every
//!   framework uses), one thread and 8 threads sharing one device pool; CuPy's entry points;
//!   the churn step below through the C API. `GPUPOOL_THREAD_CACHE=0 cargo bench` measures
//!   the same without the per-thread fast path (`src/thread_cache/`).
//! - `lock/*`: the lock choice. The same `Pool` behind `std::sync::Mutex` and behind
//!   `spin::mutex::SpinMutex<_, Yield>`, 1 and 8 threads (16 threads oversubscribes this
//!   2-core machine, the case where spinning collapses).
//!
//! - `churn/*`: bench/frameworks/churn.py's `churn` workload on the pool alone (256 live slots,
//!   each step frees a random slot and allocates a log-uniform size in [512 B, 32 MiB]) on a
//!   simulated 80 GiB device: the cost of a pair when sizes never repeat, where best fit,
//!   splitting and coalescing do real work. Time per step (one free + one malloc).
//!
//! 8-thread figures are wall time per round in which every thread does one pair.

use criterion::{criterion_group, criterion_main, Criterion};
use gpupool::config::PoolKind;
use gpupool::ffi::core::{gpupool_configure, gpupool_free, gpupool_malloc};
use gpupool::ffi::cupy::{gpupool_cupy_free, gpupool_cupy_malloc};
use gpupool::upstream::host::HostUpstream;
use gpupool::upstream::sim::SimUpstream;
use gpupool::{Pool, PoolOptions};
use std::ffi::c_void;
use std::hint::black_box;
use std::ptr::null_mut;
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

const SIZE: usize = 1 << 20;

fn c_pair(device: i32) {
    c_pair_on(device, 0)
}

/// One alloc+free pair on `stream` (a raw handle; on the host upstream any value names a stream).
fn c_pair_on(device: i32, stream: usize) {
    let mut p: *mut c_void = null_mut();
    let s = stream as *mut c_void;
    unsafe {
        gpupool_malloc(&mut p, black_box(SIZE), device, s);
        gpupool_free(black_box(p), device, s);
    }
}

/// Run `per_thread(iters)` on `threads` threads at once; wall time of the slowest.
fn parallel(threads: usize, iters: u64, per_thread: impl Fn(u64) + Sync) -> Duration {
    let barrier = Barrier::new(threads + 1);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                barrier.wait();
                per_thread(iters);
                barrier.wait();
            });
        }
        barrier.wait();
        let t = Instant::now();
        barrier.wait();
        t.elapsed()
    })
}

fn c_api(c: &mut Criterion) {
    unsafe { gpupool_configure(0, c"split".as_ptr(), c"host".as_ptr()) };
    let mut g = c.benchmark_group("c_api");
    g.bench_function("pair_1_thread", |b| b.iter(|| c_pair(0)));
    // A user stream: the thread's fast path serves each stream for itself.
    unsafe { gpupool_configure(7, c"split".as_ptr(), c"host".as_ptr()) };
    g.bench_function("pair_user_stream_1_thread", |b| b.iter(|| c_pair_on(7, 0x5000)));
    // 8 threads, each on its own stream (device 8).
    unsafe { gpupool_configure(8, c"split".as_ptr(), c"host".as_ptr()) };
    g.bench_function("pair_user_streams_8_threads", |b| {
        b.iter_custom(|iters| {
            let next = std::sync::atomic::AtomicUsize::new(0);
            parallel(8, iters, |n| {
                let stream = 0x10000 + 0x100 * next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                for _ in 0..n {
                    c_pair_on(8, stream)
                }
            })
        })
    });
    // CuPy's entry points: no stream, frees fenced in batches on the legacy stream.
    g.bench_function("cupy_pair_1_thread", |b| {
        b.iter(|| unsafe {
            let p = gpupool_cupy_malloc(null_mut(), black_box(SIZE), 0);
            gpupool_cupy_free(null_mut(), black_box(p), 0);
        })
    });
    // bench/frameworks/churn.py's churn through the C API (see `churn/*` below): sizes never
    // repeat, so every step takes the locked path; what the thread cache costs there.
    unsafe { gpupool_configure(5, c"split".as_ptr(), c"host".as_ptr()) };
    let seq = churn_sequence(1 << 16);
    let (mut slots, mut i) = ([null_mut::<c_void>(); 256], 0);
    g.bench_function("churn_step", |b| {
        b.iter(|| unsafe {
            let (slot, size) = seq[i % seq.len()];
            i += 1;
            gpupool_free(slots[slot], 5, null_mut());
            gpupool_malloc(&mut slots[slot], black_box(size), 5, null_mut());
        })
    });
    // The same churn on the arena (device 6): what its hot path costs against split's.
    unsafe { gpupool_configure(6, c"arena".as_ptr(), c"host".as_ptr()) };
    let (mut slots, mut i) = ([null_mut::<c_void>(); 256], 0);
    g.bench_function("churn_step_arena", |b| {
        b.iter(|| unsafe {
            let (slot, size) = seq[i % seq.len()];
            i += 1;
            gpupool_free(slots[slot], 6, null_mut());
            gpupool_malloc(&mut slots[slot], black_box(size), 6, null_mut());
        })
    });
    g.bench_function("pair_8_threads", |b| {
        b.iter_custom(|iters| {
            parallel(8, iters, |n| {
                for _ in 0..n {
                    c_pair(0)
                }
            })
        })
    });
    g.finish();
}

trait Lock: Send + Sync {
    fn with(&self, f: &mut dyn FnMut(&mut Pool));
}
impl Lock for Mutex<Pool> {
    fn with(&self, f: &mut dyn FnMut(&mut Pool)) {
        f(&mut self.lock().unwrap())
    }
}
impl Lock for spin::mutex::SpinMutex<Pool, spin::relax::Yield> {
    fn with(&self, f: &mut dyn FnMut(&mut Pool)) {
        f(&mut self.lock())
    }
}

fn pool() -> Pool {
    Pool::new(0, Box::new(HostUpstream::new(1 << 34)), &PoolOptions { kind: PoolKind::Split, ..Default::default() }).unwrap()
}

fn pair(l: &dyn Lock) {
    let mut a = 0;
    l.with(&mut |p| a = p.malloc(black_box(SIZE), 0).unwrap());
    l.with(&mut |p| p.free(black_box(a), 0).unwrap());
}

fn locks(c: &mut Criterion) {
    let mut g = c.benchmark_group("lock");
    let candidates: Vec<(&str, Arc<dyn Lock>)> = vec![
        ("std_mutex", Arc::new(Mutex::new(pool()))),
        ("spin_yield", Arc::new(spin::mutex::SpinMutex::<Pool, spin::relax::Yield>::new(pool()))),
    ];
    for (name, l) in candidates {
        g.bench_function(format!("{name}/1_thread"), |b| b.iter(|| pair(&*l)));
        for threads in [8usize, 16] {
            g.bench_function(format!("{name}/{threads}_threads"), |b| {
                b.iter_custom(|iters| {
                    parallel(threads, iters, |n| {
                        for _ in 0..n {
                            pair(&*l)
                        }
                    })
                })
            });
        }
    }
    g.finish();
}

/// Debug features off must cost nothing measurable: the same pool pair with
/// `GPUPOOL_DEBUG` 0 (default), 1 (timestamps), 2 (backtraces) and with a trace file.
fn debug_cost(c: &mut Criterion) {
    let mut g = c.benchmark_group("debug");
    let trace_path = std::env::temp_dir().join(format!("gpupool-bench-trace-{}.csv", std::process::id()));
    let tracer: &'static gpupool::trace::Tracer = Box::leak(Box::new(gpupool::trace::Tracer::open(&trace_path).unwrap()));
    let variants: Vec<(&str, PoolOptions)> = vec![
        ("off", PoolOptions::default()),
        ("debug_1", PoolOptions { debug: 1, ..Default::default() }),
        ("debug_2_backtraces", PoolOptions { debug: 2, ..Default::default() }),
        ("trace_on", PoolOptions { tracer: Some(tracer), ..Default::default() }),
    ];
    for (name, opts) in variants {
        let mut p = Pool::new(0, Box::new(HostUpstream::new(1 << 34)), &opts).unwrap();
        g.bench_function(name, |b| {
            b.iter(|| {
                let a = p.malloc(black_box(SIZE), 0).unwrap();
                p.free(black_box(a), 0).unwrap();
            })
        });
    }
    g.finish();
    tracer.finish();
    let _ = std::fs::remove_file(trace_path);
}

#[path = "common/churn_sequence.rs"]
mod churn_sequence;
use churn_sequence::churn_sequence;

fn churn(c: &mut Criterion) {
    let mut g = c.benchmark_group("churn");
    let seq = churn_sequence(1 << 16);
    for (name, kind, decay) in [("split", PoolKind::Split, 0), ("split_decay_8192", PoolKind::Split, 8192), ("binned", PoolKind::Binned, 0), ("arena", PoolKind::Arena, 0)] {
        let opts = PoolOptions { kind, decay_window: decay, ..Default::default() };
        let mut p = Pool::new(0, Box::new(SimUpstream::new(80 << 30)), &opts).unwrap();
        let mut slots = [0usize; 256];
        let mut i = 0;
        g.bench_function(name, |b| {
            b.iter(|| {
                let (slot, size) = seq[i % seq.len()];
                i += 1;
                if slots[slot] != 0 {
                    p.free(slots[slot], 0).unwrap();
                }
                slots[slot] = p.malloc(black_box(size), 0).unwrap();
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    targets = c_api, locks, debug_cost, churn
}
criterion_main!(benches);
