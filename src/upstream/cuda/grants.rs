//! Access grants split over a few threads of the library (`grant`).
//!
//! Why: `cuMemSetAccess` costs the driver time for every allocation a range covers (tens
//! of microseconds each), and the driver grants disjoint ranges side by side where it runs
//! imports one at a time (`docs/ipc.md` points to the measurements). A receiver's import
//! maps up to hundreds of another process's allocations and must grant them all before
//! its block can be used, so a large grant is cut at mapping boundaries into parts of
//! about equal allocation counts, granted at once by the calling thread and up to
//! `HELPERS` helper threads. A grant of a few allocations stays on the caller: waking a
//! helper costs about as much.
//!
//! The helpers start on first use and wait on one queue; each makes the caller's context
//! current for its job. A caller whose parts no helper has taken yet grants them itself,
//! so a grant never waits for a helper that is busy, failed to start or died. A `fork()`
//! child (which has no helpers: threads do not survive `fork`) grants on its own thread.

use crate::upstream::DriverCalls;
use cudarc::driver::sys;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// Helper threads at most (the caller grants a part too).
const HELPERS: usize = 3;
/// Allocations a part covers at least: a range of fewer than twice this is granted whole.
const MIN_PER_PART: usize = 8;

/// One part of a grant: its work, and the grant it belongs to.
struct Job {
    work: Box<dyn FnOnce() -> sys::CUresult + Send>,
    done: Arc<Done>,
}

/// A grant's parts still out, and the first failure any of them met.
struct Done {
    state: Mutex<(usize, sys::CUresult)>,
    finished: Condvar,
}

struct Queue {
    jobs: Mutex<VecDeque<Job>>,
    ready: Condvar,
}

/// The queue the helpers wait on, and how many were started (by this process: a fork child
/// has its own).
static QUEUE: Mutex<Option<(u32, Arc<Queue>, usize)>> = Mutex::new(None);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// `[base, base + sum of maps)`, mapped as the mappings of lengths `maps` side by side,
/// granted to the first `who` entries of `access` (one `cuMemSetAccess` a part). Returns the
/// first failure of any part (the parts already granted stay granted, as a refused whole
/// grant may leave them), else success.
pub fn grant(base: usize, maps: &[usize], access: &[sys::CUmemAccessDesc], who: usize, calls: &mut DriverCalls) -> sys::CUresult {
    let ctx = current_context();
    let parts = if ctx == 0 || crate::process::in_child() { vec![(base, maps.iter().sum())] } else { cuts(base, maps) };
    calls.set_access += parts.len() as u64;
    let who = who.min(access.len());
    let work = parts
        .into_iter()
        .map(|(addr, len)| {
            let access = access.to_vec();
            Box::new(move || {
                if current_context() != ctx {
                    // SAFETY: the context the caller has current, which outlives its grant.
                    let r = unsafe { sys::cuCtxSetCurrent(ctx as sys::CUcontext) };
                    if r != sys::CUresult::CUDA_SUCCESS {
                        return r;
                    }
                }
                // SAFETY: `access` holds at least `who` entries.
                unsafe { sys::cuMemSetAccess(addr as sys::CUdeviceptr, len, access.as_ptr(), who) }
            }) as Box<dyn FnOnce() -> sys::CUresult + Send>
        })
        .collect();
    run_parts(work)
}

/// `[base, ...)` mapped as `maps` side by side, cut at mapping boundaries into parts of
/// about equal mapping counts, `MIN_PER_PART` at least each and `HELPERS + 1` at most: each
/// part's (address, bytes).
fn cuts(base: usize, maps: &[usize]) -> Vec<(usize, usize)> {
    let parts = (maps.len() / MIN_PER_PART).clamp(1, HELPERS + 1);
    let per = maps.len() / parts;
    let mut out = Vec::with_capacity(parts);
    let mut at = base;
    for k in 0..parts {
        let these = if k + 1 == parts { &maps[k * per..] } else { &maps[k * per..(k + 1) * per] };
        let bytes: usize = these.iter().sum();
        out.push((at, bytes));
        at += bytes;
    }
    out
}

/// Run `work` (the first part on this thread, the rest on the helpers, or here where no
/// helper took them yet) and wait for all of it: the first failure, else success.
fn run_parts(mut work: Vec<Box<dyn FnOnce() -> sys::CUresult + Send>>) -> sys::CUresult {
    if work.is_empty() {
        return sys::CUresult::CUDA_SUCCESS;
    }
    let first = work.remove(0);
    let queue = if work.is_empty() { None } else { helpers(work.len()) };
    let Some(queue) = queue else {
        // No helper: every part here, in order.
        let mut r = first();
        for w in work {
            let next = w();
            if r == sys::CUresult::CUDA_SUCCESS {
                r = next;
            }
        }
        return r;
    };
    let done = Arc::new(Done { state: Mutex::new((work.len(), sys::CUresult::CUDA_SUCCESS)), finished: Condvar::new() });
    {
        let mut jobs = lock(&queue.jobs);
        jobs.extend(work.into_iter().map(|w| Job { work: w, done: done.clone() }));
    }
    queue.ready.notify_all();
    let mine = first();
    // Parts no helper took yet are granted here.
    loop {
        let left = {
            let mut jobs = lock(&queue.jobs);
            let at = jobs.iter().position(|j| Arc::ptr_eq(&j.done, &done));
            at.and_then(|i| jobs.remove(i))
        };
        match left {
            Some(job) => run(job),
            None => break,
        }
    }
    let mut state = lock(&done.state);
    while state.0 > 0 {
        state = done.finished.wait(state).unwrap_or_else(|p| p.into_inner());
    }
    if mine != sys::CUresult::CUDA_SUCCESS {
        mine
    } else {
        state.1
    }
}

/// The calling thread's current context (0: none).
fn current_context() -> usize {
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: writes one pointer.
    if unsafe { sys::cuCtxGetCurrent(&mut ctx) } != sys::CUresult::CUDA_SUCCESS {
        return 0;
    }
    ctx as usize
}

/// Run one part and count it done (a panic counts as a failure: the caller must not wait
/// for ever).
fn run(job: Job) {
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job.work)).unwrap_or(sys::CUresult::CUDA_ERROR_UNKNOWN);
    let mut state = lock(&job.done.state);
    state.0 -= 1;
    if r != sys::CUresult::CUDA_SUCCESS && state.1 == sys::CUresult::CUDA_SUCCESS {
        state.1 = r;
    }
    drop(state);
    job.done.finished.notify_all();
}

/// The helpers' queue, with at least `want` helpers started where they can be (`None`: none
/// could be).
fn helpers(want: usize) -> Option<Arc<Queue>> {
    let pid = std::process::id();
    let mut q = lock(&QUEUE);
    if q.as_ref().is_some_and(|(owner, _, _)| *owner != pid) {
        *q = None; // a fork child's copy of its parent's: no thread waits on it here
    }
    let (_, queue, started) = q.get_or_insert_with(|| (pid, Arc::new(Queue { jobs: Mutex::new(VecDeque::new()), ready: Condvar::new() }), 0));
    while *started < want.min(HELPERS) {
        let theirs = queue.clone();
        let spawned = std::thread::Builder::new().name("gpupool-grant".into()).spawn(move || loop {
            let job = {
                let mut jobs = lock(&theirs.jobs);
                loop {
                    if let Some(j) = jobs.pop_front() {
                        break j;
                    }
                    jobs = theirs.ready.wait(jobs).unwrap_or_else(|p| p.into_inner());
                }
            };
            run(job);
        });
        if spawned.is_err() {
            break;
        }
        *started += 1;
    }
    (*started > 0).then(|| queue.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn a_grant_is_cut_at_mapping_boundaries_into_parts_of_about_equal_counts() {
        let g = 2usize << 20;
        // Under twice the least a part covers: whole.
        assert_eq!(cuts(0x1000_0000, &[g; 15]), vec![(0x1000_0000, 15 * g)]);
        // 20 mappings: two parts of 10.
        assert_eq!(cuts(0, &[g; 20]), vec![(0, 10 * g), (10 * g, 10 * g)]);
        // 100 mappings: four parts at most, the last takes the rest; a chunk stays whole.
        let mut maps = vec![g; 99];
        maps.push(64 * g);
        let c = cuts(0, &maps);
        assert_eq!(c.len(), HELPERS + 1);
        assert_eq!(c.iter().map(|p| p.1).sum::<usize>(), maps.iter().sum::<usize>());
        assert_eq!(c[0], (0, 25 * g));
        assert_eq!(*c.last().unwrap(), (75 * g, 24 * g + 64 * g));
        for w in c.windows(2) {
            assert_eq!(w[0].0 + w[0].1, w[1].0, "parts lie side by side");
        }
    }

    #[test]
    fn every_part_runs_once_and_the_first_failure_is_returned() {
        let ran = Arc::new(AtomicUsize::new(0));
        let part = |r: sys::CUresult| {
            let ran = ran.clone();
            Box::new(move || {
                ran.fetch_add(1, Ordering::SeqCst);
                std::thread::sleep(std::time::Duration::from_millis(2));
                r
            }) as Box<dyn FnOnce() -> sys::CUresult + Send>
        };
        let ok = sys::CUresult::CUDA_SUCCESS;
        assert_eq!(run_parts(vec![part(ok), part(ok), part(ok), part(ok)]), ok);
        assert_eq!(ran.load(Ordering::SeqCst), 4);
        let bad = sys::CUresult::CUDA_ERROR_INVALID_VALUE;
        assert_eq!(run_parts(vec![part(ok), part(ok), part(bad), part(ok)]), bad);
        assert_eq!(run_parts(vec![part(bad)]), bad);
        assert_eq!(ran.load(Ordering::SeqCst), 9);
        // A part that panics counts as failed; the rest still run and nothing waits for ever.
        let boom = Box::new(|| -> sys::CUresult { panic!("a part panics") }) as Box<dyn FnOnce() -> sys::CUresult + Send>;
        assert_eq!(run_parts(vec![part(ok), boom, part(ok)]), sys::CUresult::CUDA_ERROR_UNKNOWN);
        assert_eq!(ran.load(Ordering::SeqCst), 11);
        // Many grants at once from many threads: every part of each runs once.
        let ran2 = Arc::new(AtomicUsize::new(0));
        std::thread::scope(|s| {
            for _ in 0..8 {
                let ran2 = ran2.clone();
                s.spawn(move || {
                    for _ in 0..20 {
                        let parts = (0..4)
                            .map(|_| {
                                let ran2 = ran2.clone();
                                Box::new(move || {
                                    ran2.fetch_add(1, Ordering::SeqCst);
                                    sys::CUresult::CUDA_SUCCESS
                                }) as Box<dyn FnOnce() -> sys::CUresult + Send>
                            })
                            .collect();
                        assert_eq!(run_parts(parts), sys::CUresult::CUDA_SUCCESS);
                    }
                });
            }
        });
        assert_eq!(ran2.load(Ordering::SeqCst), 8 * 20 * 4);
    }
}
