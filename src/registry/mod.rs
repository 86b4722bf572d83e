//! The process-wide registry: each device's pool, created lazily, as a set of shards with
//! a lock each, plus the environment configuration read once.
//!
//! Shards, and why. One lock per device made every thread on every stream wait for every
//! other: sixteen threads churning sixteen streams ran at a fifth of one thread's rate.
//! So a device's pool is `1 + GPUPOOL_STREAM_SHARDS` independent pools
//! (`Pool`, each with its own strategy, books, stream events and upstream instance):
//! - shard 0 serves the legacy stream, the per-thread default stream, callers that name
//!   no stream (CuPy) and the private pools (CUDA graphs, `MemPool`s) made outside tags
//!   (while one routes allocations, every untagged allocation goes to shard 0; a tag's
//!   pool holds those made under the tag: `private_pools.rs`), and holds the settings;
//! - each user stream is placed on one of shards `1..=n` the first time it allocates
//!   (`streams.rs`, round robin) and allocates there from then on, unless it finds another
//!   live stream allocating there too and an idle shard to move to;
//! - a free goes to the shard that holds the block: the freeing stream's shard first (a
//!   block is mostly freed on the stream it was allocated for), else the one the address
//!   index names (`crate::owners`);
//! - the device's limit and reserved bytes are one `Budget` that every shard claims from
//!   before it grows, so the limit caps the device;
//! - a shard out of memory asks the others to give their cached memory back (each under
//!   its own lock, never two at once) and tries once more, so memory cached for one
//!   stream never makes another fail;
//! - reports add the shards up (`reports.rs`).
//!
//! Files: this one holds the slots, their locks and the device's life (creation,
//! `configure`, `install`, limits); `which_shard.rs` which shard a call goes to; `streams.rs` the
//! stream placements; `reports.rs` the device-wide reports.
//!
//! What it costs: memory cached on one stream's shard serves only that shard until memory
//! runs short; PyTorch's allocator keeps each stream's blocks to that stream in the same
//! way. An arena device's shards are arenas of their own, each over its own reserved
//! ranges (a stream's blocks coalesce within its shard, as a `split` shard's do). Not
//! sharded: a pool over a caller's upstream (`install`), and the test-only unsafe stream mode.
//!
//! Locks: a thread holds at most one shard lock, except `fork`, `configure` and `install`,
//! which take them all in index order. Lock choice: `std::sync::Mutex` (futex: a short
//! spin, then the thread parks). Uncontended it costs about what `spin::Mutex<Yield>` does
//! (`cargo bench --bench malloc_free` compares them), and unlike a spin lock it is safe to hold across the driver calls the grow/reclaim paths
//! make (a spinning waiter burns a core for as long as a driver call takes, and spin locks
//! collapse when threads outnumber cores).

mod private_pools;
mod reports;
mod which_shard;
mod streams;
mod tags;

pub use reports::{memory_status, reset_peaks, snapshot_json, stats, stats_json};
pub use tags::{pause_tag, place_tag, resume_tag, tag_backup_drop, tag_backup_prepare, tag_paused_bytes, tag_shard};
pub use private_pools::{begin_route, create_private_pool, empty_private_pool, end_route, private_pool_uses, release_private_pool, routed_tag_shards};
pub use which_shard::{counted_twice, lock_holder, placement_epoch, pool_made, release_other_shards, shard_for, shard_placed, worth_other_shards};

use crate::config::{Config, PoolKind, UpstreamKind, MAX_STREAM_SHARDS};
use crate::error::{Error, Result};
use crate::pool::{Budget, Pool, PoolOptions};
use crate::upstream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use streams::StreamShards;

/// Device ids accepted: `0..MAX_DEVICES` (CUDA upstreams further check the device count).
pub const MAX_DEVICES: usize = 64;

/// Shards a device may have: shard 0 and the stream shards.
pub const SHARDS: usize = 1 + MAX_STREAM_SHARDS;

/// Every pool of a device: its shards, then one per tag (`tags.rs`).
const POOLS: usize = SHARDS + crate::tags::MAX_TAGS;

/// The hot-path lock around each shard.
pub type PoolLock<T> = Mutex<T>;

/// A per-device override of the environment's pool/upstream choice (`gpupool_configure`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Choice {
    pub pool: PoolKind,
    pub upstream: UpstreamKind,
}

/// `DevicePools::stream_shards` before shard 0 was made.
const NOT_MADE: usize = usize::MAX;

/// A shard's lock and pool on cache lines of its own: one thread's updates of its shard's
/// counters must not slow down the next shard's lock (false sharing).
#[repr(align(128))]
struct Shard(PoolLock<Option<Pool>>);

impl std::ops::Deref for Shard {
    type Target = PoolLock<Option<Pool>>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

/// A device's pools (its shards, then one per tag), its override of the configuration, its
/// budget and its streams' placement.
struct DevicePools {
    shards: [Shard; POOLS],
    choice: Mutex<Option<Choice>>,
    /// Stream shards of the pool as made (0: one pool for every stream; `NOT_MADE`).
    stream_shards: AtomicUsize,
    /// The budget the device's shards share (made with shard 0).
    budget: Mutex<Option<Arc<Budget>>>,
    streams: StreamShards,
    /// Tags whose pool on this device routes allocations to a private pool now (bit per
    /// tag index; `private_pools.rs`).
    routed_tags: std::sync::atomic::AtomicU32,
}

impl DevicePools {
    /// Set the device's stream-shard count; answers of `shard_for` remembered before are
    /// stale from now on (`which_shard::placement_epoch`).
    fn set_stream_shards(&self, n: usize) {
        self.stream_shards.store(n, Ordering::Release);
        which_shard::placements_changed();
    }
}

#[allow(clippy::declare_interior_mutable_const)]
const NO_POOL: Shard = Shard(Mutex::new(None));
#[allow(clippy::declare_interior_mutable_const)]
const NO_POOLS: DevicePools = DevicePools {
    shards: [NO_POOL; POOLS],
    choice: Mutex::new(None),
    stream_shards: AtomicUsize::new(NOT_MADE),
    budget: Mutex::new(None),
    streams: StreamShards::new(),
    routed_tags: std::sync::atomic::AtomicU32::new(0),
};
static DEVICES: [DevicePools; MAX_DEVICES] = [NO_POOLS; MAX_DEVICES];
static PINNED: PoolLock<Option<Pool>> = Mutex::new(None);
/// The environment's configuration (`config::get`).
pub fn config() -> Result<&'static Config> {
    crate::config::get()
}

/// Why no pool can be made under the environment's settings: a malformed value, or a
/// trace file a pool could not open. None when they are fine (or the trace was not tried).
pub fn settings_error() -> Option<Error> {
    config().err().or_else(crate::trace::open_error)
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
    lock_or_stop(m, m.lock())
}

fn lock_or_stop(
    m: &'static PoolLock<Option<Pool>>,
    r: std::sync::LockResult<MutexGuard<'static, Option<Pool>>>,
) -> MutexGuard<'static, Option<Pool>> {
    r.unwrap_or_else(|poisoned| {
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

fn device_pools(device: i32) -> Result<&'static DevicePools> {
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
    Ok(&DEVICES[device as usize])
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
        event_batch_bytes: cfg.event_batch_bytes,
        arena_lend: cfg.arena_lend,
        arena_chunk: cfg.arena_chunk,
        arena_chunk_from: cfg.arena_chunk_from,
        arena_piece_ends: cfg.arena_piece_ends,
        arena_granule: 0,
        private_pools_mapped: false,
        budget: None,
        shard: 0,
    })
}

/// Make shard `shard` of `device`'s pool (shard 0 first: it fixes the device's shard count).
fn create(device: i32, shard: usize, s: &DevicePools) -> Result<Pool> {
    let cfg = config()?;
    let mut c = lock(&s.choice).unwrap_or(Choice { pool: cfg.pool, upstream: cfg.upstream });
    let tag_memory = shard.checked_sub(SHARDS).map(crate::tags::memory);
    if tag_memory == Some(crate::tags::TagMemory::CudaIpc) {
        // Note [A tag's memory]: `cuMemAlloc` segments (host memory on a host device).
        c.pool = PoolKind::Split;
        if c.upstream != UpstreamKind::Host {
            c.upstream = UpstreamKind::Device;
        }
    }
    let mut opts = options(cfg, c.pool)?; // configuration errors (a bad trace path) come first
    let up = upstream::make::build(c.upstream, device, cfg.host_capacity)?;
    opts.budget = Some(lock(&s.budget).get_or_insert_with(Default::default).clone());
    opts.shard = shard as u16;
    if tag_memory == Some(crate::tags::TagMemory::Pausable) {
        // A tag's memory is allocations of one size, TAG_GRANULE each (Note [A tag's
        // granule]).
        opts.arena_chunk = 0;
        opts.arena_granule = crate::tags::TAG_GRANULE;
        // Its CUDA graphs' and MemPools' memory pauses with it (Note [Graph pools under a tag]).
        opts.private_pools_mapped = true;
    }
    let pool = Pool::new(device, up, &opts)?;
    if shard == 0 {
        // The unsafe test mode must reuse across streams at once (its test shows the
        // stream tests catch that), which one pool per stream would never do.
        let n = if cfg.unsafe_ignore_streams { 0 } else { cfg.stream_shards };
        s.set_stream_shards(n);
    }
    Ok(pool)
}

/// A shard's pool, locked: the guard the front end holds across one operation
/// (`crate::front`), so that its own steps run under the lock without a closure handed
/// down to the registry.
pub struct PoolGuard(MutexGuard<'static, Option<Pool>>);

impl std::ops::Deref for PoolGuard {
    type Target = Pool;
    fn deref(&self) -> &Pool {
        self.0.as_ref().expect("a guard is made only over a pool")
    }
}

impl std::ops::DerefMut for PoolGuard {
    fn deref_mut(&mut self) -> &mut Pool {
        self.0.as_mut().expect("a guard is made only over a pool")
    }
}

/// Lock shard `shard` of `device`'s pool, creating it on first use (a tag's pool after
/// shard 0, which holds the device's settings and makes the device known to the reports).
pub fn lock_shard(device: i32, shard: usize) -> Result<PoolGuard> {
    let s = device_pools(device)?;
    if shard >= SHARDS && s.stream_shards.load(Ordering::Acquire) == NOT_MADE {
        drop(lock_shard(device, 0)?);
    }
    let mut g = lock_pool(&s.shards[shard]);
    if g.is_none() {
        *g = Some(create(device, shard, s)?);
    }
    Ok(PoolGuard(g))
}

/// `lock_shard` for an allocation on `stream`, which may move the stream to another shard
/// for later allocations when another stream allocates on this one too
/// (`StreamShards::allocating`).
pub fn lock_stream_shard(device: i32, shard: usize, stream: usize) -> Result<PoolGuard> {
    let g = lock_shard(device, shard)?;
    let s = &DEVICES[device as usize];
    let n = s.stream_shards.load(Ordering::Acquire);
    if shard != 0 && shard < SHARDS && n != 0 && n != NOT_MADE {
        s.streams.allocating(stream, shard, n);
    }
    Ok(g)
}

/// Run `f` on shard `shard` of `device`'s pool, creating it on first use.
pub fn with_shard<R>(device: i32, shard: usize, f: impl FnOnce(&mut Pool) -> Result<R>) -> Result<R> {
    f(&mut *lock_shard(device, shard)?)
}

/// Run `f` on shard 0 of `device`'s pool (creating it on first use): the legacy stream's,
/// stream-less callers' and private pools' shard, which holds the device's settings.
pub fn with_pool<R>(device: i32, f: impl FnOnce(&mut Pool) -> Result<R>) -> Result<R> {
    with_shard(device, 0, f)
}

/// Run `f` on shard 0 of `device`'s pool only if it exists.
pub fn with_existing<R>(device: i32, f: impl FnOnce(&mut Pool) -> R) -> Result<Option<R>> {
    let s = device_pools(device)?;
    let mut g = lock_pool(&s.shards[0]);
    Ok(g.as_mut().map(f))
}

/// Run `f` on every existing shard of `device`'s pool in turn (one lock at a time).
pub fn for_each_shard(device: i32, mut f: impl FnMut(&mut Pool)) -> Result<()> {
    let s = device_pools(device)?;
    for m in &s.shards {
        if let Some(p) = lock_pool(m).as_mut() {
            f(p);
        }
    }
    Ok(())
}

/// Devices whose pools exist.
pub fn existing_devices() -> Vec<i32> {
    (0..MAX_DEVICES as i32).filter(|&d| lock_pool(&DEVICES[d as usize].shards[0]).is_some()).collect()
}

/// Run `f` on the pool (any device, any shard) that has `ptr` live; `None` if none has.
pub fn with_owner_of<R>(ptr: usize, f: impl FnOnce(&mut Pool) -> Result<R>) -> Option<Result<R>> {
    // The range index names the one pool to ask (no lock on the others).
    let o = crate::owners::lookup(ptr)?;
    let m = DEVICES.get(usize::try_from(o.device).ok()?)?.shards.get(o.shard as usize)?;
    let mut g = lock_pool(m);
    g.as_mut().filter(|p| p.owns(ptr)).map(f)
}

/// Whether pool shard `shard` is a tag's (`tags.rs`): its memory may be paused.
pub fn is_tag_shard(shard: u16) -> bool {
    shard as usize >= SHARDS
}

/// The device whose pool has `ptr` live, if any.
pub fn find_owner(ptr: usize) -> Option<i32> {
    with_owner_of(ptr, |p| Ok(p.device())).and_then(|r| r.ok())
}

/// Every shard lock of `device`, in index order (`configure`, `install`).
fn lock_device(s: &'static DevicePools) -> Vec<MutexGuard<'static, Option<Pool>>> {
    s.shards.iter().map(|m| lock_pool(m)).collect()
}

/// A pool may be replaced only with nothing live in it (thread caches emptied first).
fn ensure_idle(shards: &mut [MutexGuard<'static, Option<Pool>>], device: i32) -> Result<()> {
    for g in shards.iter_mut() {
        if let Some(p) = g.as_mut() {
            p.flush_thread_caches(None);
            p.importer().drop_all();
            if p.live_count() > 0 {
                let live = p.live_count();
                return Err(Error::Busy(match p.paused_frees() {
                    Some((tag, freed)) if freed == live => format!(
                        "cannot reconfigure device {device}: memory tagged `{tag}` is paused, and its {freed} freed \
                         allocation(s) are given back when it resumes; resume it first"
                    ),
                    Some((tag, freed)) => format!(
                        "cannot reconfigure device {device}: {} allocation(s) are still live, and memory tagged `{tag}` is \
                         paused ({freed} more freed, given back when it resumes); free them and resume it first",
                        live - freed
                    ),
                    None => format!("cannot reconfigure device {device}: {live} allocation(s) are still live; free them first"),
                }));
            }
            let importer = p.importer();
            let (open, kept) = (importer.open_count(), importer.kept());
            if open > 0 {
                return Err(Error::Busy(format!(
                    "cannot reconfigure device {device}: {open} block(s) of other processes are mapped; gpupool_ipc_close them first"
                )));
            }
            if kept > 0 {
                return Err(Error::Busy(format!(
                    "cannot reconfigure device {device}: {kept} kept mapping(s) of other processes' memory could not be unmapped"
                )));
            }
        }
    }
    Ok(())
}

/// Choose the strategy and/or upstream of `device` at run time. Allowed while the device's
/// pool has no live allocations; its cached memory is released first. A failure (no
/// driver, bad device) leaves the current pool in place.
pub fn configure(device: i32, pool: Option<PoolKind>, upstream: Option<UpstreamKind>) -> Result<()> {
    let s = device_pools(device)?;
    let cfg = config()?;
    let mut shards = lock_device(s);
    ensure_idle(&mut shards, device)?;
    let old = lock(&s.choice).unwrap_or(Choice { pool: cfg.pool, upstream: cfg.upstream });
    let new = Choice { pool: pool.unwrap_or(old.pool), upstream: upstream.unwrap_or(old.upstream) };
    *lock(&s.choice) = Some(new);
    let old_budget = lock(&s.budget).replace(Arc::default());
    let old_count = s.stream_shards.load(Ordering::Acquire);
    match create(device, 0, s) {
        Ok(fresh) => {
            // The old shards drop here, which releases their cache.
            for g in shards.iter_mut().skip(1) {
                **g = None;
            }
            *shards[0] = Some(fresh);
            s.routed_tags.store(0, Ordering::Release);
            Ok(())
        }
        Err(e) => {
            *lock(&s.choice) = Some(old);
            *lock(&s.budget) = old_budget;
            s.set_stream_shards(old_count);
            Err(e)
        }
    }
}

/// Run `device`'s pool over the caller's `upstream` with strategy `kind` (and the
/// environment's other settings), replacing the pool it had, on the same terms as
/// `configure`: no live allocations. For embedders with their own memory source and for
/// tests with instrumented upstreams (RMM's `set_per_device_resource` plays this part).
/// One upstream serves one pool: such a device is not sharded.
pub fn install(device: i32, kind: PoolKind, upstream: Box<dyn upstream::Upstream>) -> Result<()> {
    let s = device_pools(device)?;
    let cfg = config()?;
    let mut shards = lock_device(s);
    ensure_idle(&mut shards, device)?;
    let budget = Arc::new(Budget::default());
    let fresh = Pool::new(device, upstream, &PoolOptions { budget: Some(budget.clone()), ..options(cfg, kind)? })?;
    for g in shards.iter_mut().skip(1) {
        **g = None;
    }
    *shards[0] = Some(fresh);
    s.routed_tags.store(0, Ordering::Release);
    *lock(&s.budget) = Some(budget);
    s.set_stream_shards(0);
    Ok(())
}

/// Run `f` on the pinned host pool, creating it on first use.
pub fn with_pinned<R>(f: impl FnOnce(&mut Pool) -> Result<R>) -> Result<R> {
    crate::fork::check(lock_all_for_fork)?;
    let mut g = lock_pool(&PINNED);
    if g.is_none() {
        let cfg = config()?;
        let up = upstream::make::build_pinned()?;
        *g = Some(Pool::new(-1, up, &options(cfg, PoolKind::Split)?)?);
    }
    f(g.as_mut().expect("pinned pool created above"))
}

/// Let device `peer` read and write what `owner`'s pools map, now and from now on (Note
/// [Peer access on demand] in `upstream/peers.rs`); -1 for either: every device, every
/// peer that can (the grants of every peer, as before grants were made on demand).
/// Recorded for pools made later, and granted by every pool of `owner` that exists.
/// Returns the grants made.
pub fn enable_peer_access(owner: i32, peer: i32) -> Result<usize> {
    let limit = MAX_DEVICES.min(upstream::peers::MAX_PEER_DEVICES) as i32;
    for (id, what) in [(owner, "device"), (peer, "peer")] {
        if id < -1 || id >= limit {
            return Err(Error::InvalidDevice { device: id, detail: format!("{what} ids are 0..{} (-1: every one)", limit - 1) });
        }
    }
    let owners = if owner == -1 { existing_devices() } else { vec![owner] };
    for &o in &owners {
        device_pools(o)?;
    }
    if peer == owner && owner >= 0 {
        return Ok(0); // a device is its own peer already
    }
    upstream::peers::enable(owner, peer);
    let (mut total, mut first) = (0, None);
    for o in owners {
        if o == peer {
            continue;
        }
        for m in &DEVICES[o as usize].shards {
            if let Some(p) = lock_pool(m).as_mut() {
                match p.enable_peer(peer) {
                    Ok(n) => total += n,
                    Err(e) => {
                        first.get_or_insert(e);
                    }
                }
            }
        }
    }
    first.map_or(Ok(total), Err)
}

/// Give every wholly free cached segment of `device` back (every shard): the bytes the
/// shards released, and the first error of a shard that could not (the others still
/// release). `None`: no pool.
pub fn reclaim(device: i32) -> Result<Option<(usize, Option<Error>)>> {
    let mut total: Option<(usize, Option<Error>)> = None;
    for_each_shard(device, |p| {
        let (bytes, first) = total.get_or_insert((0, None));
        match p.reclaim() {
            Ok(n) => *bytes += n,
            Err(e) => {
                first.get_or_insert(e);
            }
        }
    })?;
    Ok(total)
}

/// Cap `device`'s reserved bytes at `bytes` (0 = none); every shard releases cached memory
/// while the device is above it. A cap above the device's memory is refused
/// (`limits::within_device`).
pub fn set_limit(device: i32, bytes: usize) -> Result<()> {
    with_pool(device, |p| {
        if bytes != 0 {
            crate::pool::within_device(bytes, p.mem_info()?.1, p.upstream_name(), &format!("device {device}"))?;
        }
        p.set_limit(bytes)
    })?;
    let mut first = None;
    for_each_shard(device, |p| {
        if let Err(e) = p.release_over_limit() {
            first.get_or_insert(e);
        }
    })?;
    first.map_or(Ok(()), Err)
}

/// The leak report over every device pool (and the pinned pool): live allocations,
/// largest first, with what `GPUPOOL_DEBUG` recorded.
pub fn leak_report() -> String {
    let mut leaks = Vec::new();
    for d in existing_devices() {
        let _ = for_each_shard(d, |p| leaks.append(&mut p.leaks()));
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
    let mut guards: Vec<MutexGuard<'static, Option<Pool>>> = DEVICES.iter().flat_map(|s| s.shards.iter().map(|m| lock_pool(m))).collect();
    guards.push(lock_pool(&PINNED));
    guards
}

/// The status report of every device pool in use (what `gpupool_memory_status(-1)` returns).
pub fn status_report() -> String {
    let parts: Vec<String> = existing_devices().into_iter().filter_map(|d| memory_status(d).ok()).collect();
    if parts.is_empty() {
        "gpupool: no device pool in use yet\n".into()
    } else {
        parts.concat()
    }
}
