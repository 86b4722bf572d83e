//! The process-wide registry: one lazily created pool per device (and one pinned pool),
//! each behind its own lock, plus the environment configuration read once.
//!
//! Lock choice: `std::sync::Mutex` (futex: a short spin, then the thread parks). Measured
//! with `cargo bench --bench malloc_free` (see README "Lock choice"): uncontended it costs
//! about what `spin::Mutex<Yield>` does, and unlike a spin lock it is safe to hold across
//! the driver calls the grow/reclaim paths make (a spinning waiter burns a core for as long
//! as a driver call takes, and spin locks collapse when threads outnumber cores).

use crate::config::{Config, PoolKind, UpstreamKind};
use crate::error::{Error, Result};
use crate::pool::{Pool, PoolOptions};
use crate::upstream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

/// Device ids accepted: `0..MAX_DEVICES` (CUDA upstreams further check the device count).
pub const MAX_DEVICES: usize = 64;

/// The hot-path lock around each device pool.
pub type PoolLock<T> = Mutex<T>;

/// A per-device override of the environment's pool/upstream choice (`gpupool_configure`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Choice {
    pub pool: PoolKind,
    pub upstream: UpstreamKind,
}

struct Slot {
    pool: PoolLock<Option<Pool>>,
    choice: Mutex<Option<Choice>>,
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY_SLOT: Slot = Slot { pool: Mutex::new(None), choice: Mutex::new(None) };
static SLOTS: [Slot; MAX_DEVICES] = [EMPTY_SLOT; MAX_DEVICES];
static PINNED: PoolLock<Option<Pool>> = Mutex::new(None);
/// The environment's configuration (`config::get`).
pub fn config() -> Result<&'static Config> {
    crate::config::get()
}

/// Lock a plain registry mutex (a configuration choice), recovering from poisoning: nothing
/// in it can be half-updated.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| {
        m.clear_poison();
        poisoned.into_inner()
    })
}

/// Lock a pool. A poisoned lock means a panic interrupted an operation on this pool (the C
/// boundary caught and reported it): its books may be half-updated, so rather than risk
/// handing memory out twice the pool is stopped (`Pool::stop`) and says so from then on.
fn lock_pool(m: &'static PoolLock<Option<Pool>>) -> MutexGuard<'static, Option<Pool>> {
    m.lock().unwrap_or_else(|poisoned| {
        m.clear_poison();
        let mut g = poisoned.into_inner();
        if let Some(p) = g.as_mut() {
            let why = crate::error::last_panic().unwrap_or_else(|| "an operation was interrupted by a panic".into());
            p.stop(&why);
        }
        g
    })
}

/// Set once the process-wide checks of `slot` passed (configuration parsed, fork handlers
/// installed): from then on a call pays two relaxed loads for them, not the checks.
static CHECKED: AtomicBool = AtomicBool::new(false);

fn slot(device: i32) -> Result<&'static Slot> {
    if !CHECKED.load(Ordering::Acquire) || crate::process::in_child() {
        crate::fork::check(lock_all_for_fork)?;
        // A malformed environment variable fails every call that reaches a pool, frees and
        // reclaims included, with the message that names it (so this is never marked done).
        config()?;
        CHECKED.store(true, Ordering::Release);
    }
    if device < 0 || device as usize >= MAX_DEVICES {
        return Err(Error::InvalidDevice { device, detail: format!("device ids are 0..{}", MAX_DEVICES - 1) });
    }
    Ok(&SLOTS[device as usize])
}

fn options(cfg: &Config, kind: PoolKind) -> Result<PoolOptions> {
    if cfg.debug >= 1 {
        crate::process::on_exit(print_leak_summary);
    }
    if cfg.status_socket {
        crate::status_socket::start(status_report);
    }
    Ok(PoolOptions {
        kind,
        limit: cfg.limit,
        check_invariants: cfg.check_invariants,
        unsafe_ignore_streams: cfg.unsafe_ignore_streams,
        debug: cfg.debug,
        tracer: crate::trace::global()?,
        decay_window: cfg.decay_window,
        arena_va: cfg.arena_va,
        thread_cache: cfg.thread_cache,
        event_batch: cfg.event_batch,
        arena_lend: cfg.arena_lend,
    })
}

fn create(device: i32, choice: Option<Choice>) -> Result<Pool> {
    let cfg = config()?;
    let c = choice.unwrap_or(Choice { pool: cfg.pool, upstream: cfg.upstream });
    let opts = options(cfg, c.pool)?; // configuration errors (a bad trace path) come first
    let up = upstream::build(c.upstream, device, cfg.host_capacity)?;
    Pool::new(device, up, &opts)
}

/// Run `f` on `device`'s pool, creating it on first use.
pub fn with_pool<R>(device: i32, f: impl FnOnce(&mut Pool) -> Result<R>) -> Result<R> {
    let s = slot(device)?;
    let mut g = lock_pool(&s.pool);
    if g.is_none() {
        let choice = *lock(&s.choice);
        *g = Some(create(device, choice)?);
    }
    f(g.as_mut().expect("pool created above"))
}

/// Run `f` on `device`'s pool only if it exists.
pub fn with_existing<R>(device: i32, f: impl FnOnce(&mut Pool) -> R) -> Result<Option<R>> {
    let s = slot(device)?;
    let mut g = lock_pool(&s.pool);
    Ok(g.as_mut().map(f))
}

/// Devices whose pools exist.
pub fn existing_devices() -> Vec<i32> {
    (0..MAX_DEVICES as i32).filter(|&d| lock_pool(&SLOTS[d as usize].pool).is_some()).collect()
}

/// The device whose pool has `ptr` live, if any.
pub fn find_owner(ptr: usize) -> Option<i32> {
    // The range index names the one pool to ask (no lock on the others).
    let d = crate::owners::lookup(ptr)?;
    lock_pool(&SLOTS[d as usize].pool).as_ref().is_some_and(|p| p.owns(ptr)).then_some(d)
}

/// A pool may be replaced only with nothing live in it (thread caches emptied first).
fn ensure_idle(pool: Option<&mut Pool>, device: i32) -> Result<()> {
    if let Some(p) = pool {
        p.flush_thread_caches(None);
        if p.live_count() > 0 {
            return Err(Error::Busy(format!(
                "cannot reconfigure device {device}: {} allocation(s) are still live; free them first",
                p.live_count()
            )));
        }
    }
    Ok(())
}

/// Choose the strategy and/or upstream of `device` at run time. Allowed while the device's
/// pool has no live allocations; its cached memory is released first. A failure (no
/// driver, bad device) leaves the current pool in place.
pub fn configure(device: i32, pool: Option<PoolKind>, upstream: Option<UpstreamKind>) -> Result<()> {
    let s = slot(device)?;
    let cfg = config()?;
    let mut g = lock_pool(&s.pool);
    ensure_idle(g.as_mut(), device)?;
    let mut choice = lock(&s.choice);
    let old = choice.unwrap_or(Choice { pool: cfg.pool, upstream: cfg.upstream });
    let new = Choice { pool: pool.unwrap_or(old.pool), upstream: upstream.unwrap_or(old.upstream) };
    let fresh = create(device, Some(new))?;
    *g = Some(fresh); // drops the old pool, which releases its cache
    *choice = Some(new);
    Ok(())
}

/// Run `device`'s pool over the caller's `upstream` with strategy `kind` (and the
/// environment's other settings), replacing the pool it had, on the same terms as
/// `configure`: no live allocations. For embedders with their own memory source and for
/// tests with instrumented upstreams (RMM's `set_per_device_resource` plays this part).
pub fn install(device: i32, kind: PoolKind, upstream: Box<dyn upstream::Upstream>) -> Result<()> {
    let s = slot(device)?;
    let cfg = config()?;
    let mut g = lock_pool(&s.pool);
    ensure_idle(g.as_mut(), device)?;
    let fresh = Pool::new(device, upstream, &options(cfg, kind)?)?;
    *g = Some(fresh);
    Ok(())
}

/// Run `f` on the pinned host pool, creating it on first use.
pub fn with_pinned<R>(f: impl FnOnce(&mut Pool) -> Result<R>) -> Result<R> {
    crate::fork::check(lock_all_for_fork)?;
    let mut g = lock_pool(&PINNED);
    if g.is_none() {
        let cfg = config()?;
        let up = upstream::build_pinned()?;
        *g = Some(Pool::new(-1, up, &options(cfg, PoolKind::Split)?)?);
    }
    f(g.as_mut().expect("pinned pool created above"))
}

/// The leak report over every device pool (and the pinned pool): live allocations,
/// largest first, with what `GPUPOOL_DEBUG` recorded.
pub fn leak_report() -> String {
    let mut leaks = Vec::new();
    for d in existing_devices() {
        if let Ok(Some(mut l)) = with_existing(d, |p| p.leaks()) {
            leaks.append(&mut l);
        }
    }
    if let Some(p) = lock_pool(&PINNED).as_ref() {
        leaks.extend(p.leaks());
    }
    crate::debug::render(leaks, config().map(|c| c.debug).unwrap_or(0))
}

/// At exit with `GPUPOOL_DEBUG` >= 1: the leak summary, when anything is still live.
fn print_leak_summary() {
    let report = leak_report();
    if !report.starts_with("gpupool: 0 live") {
        crate::error::warn(&report);
    }
}

/// `fork()` support (`fork.rs`): hold every pool lock across the fork, so that the child's
/// copies are not caught in the middle of an update by a thread that does not exist there.
pub(crate) fn lock_all_for_fork() -> Vec<MutexGuard<'static, Option<Pool>>> {
    let mut guards: Vec<MutexGuard<'static, Option<Pool>>> = SLOTS.iter().map(|s| lock_pool(&s.pool)).collect();
    guards.push(lock_pool(&PINNED));
    guards
}

/// The status report of every device pool in use (what `gpupool_memory_status(-1)` returns).
pub fn status_report() -> String {
    let parts: Vec<String> = existing_devices().into_iter().filter_map(|d| with_existing(d, |p| p.memory_status()).ok().flatten()).collect();
    if parts.is_empty() {
        "gpupool: no device pool in use yet\n".into()
    } else {
        parts.concat()
    }
}
