//! One device's pool: the facade that ties a strategy, an upstream and the stream tracker
//! together, and owns the live-pointer map, the limit, the counters and the OOM escalation.
//! Allocation, limits and the pool's lifetime are here. Elsewhere: frees (one entry point,
//! `Pool::free`, told by `FreeOn` what is known of the stream) in `free.rs`; finding memory
//! and the escalation in `grow.rs`, the arena's driver calls in `arena.rs`; giving memory
//! back in `release.rs`; private pools for CUDA graphs in `graph_pools.rs`; the pool's side
//! of the thread caches in `attached_caches/`; exports to other processes in `ipc.rs`;
//! reports and snapshots in `reports.rs` and `snapshot.rs`; the budget a device's shards
//! share in `budget.rs`; how a pool is built in `options.rs`.
//!
//! Escalation when a request finds no cached block (PyTorch's order):
//! take cached → flush deferred frees and retry → grow (preferred segment size, then the
//! minimal one; the arena maps a window) → wait for the whole device if some stream's frees
//! are covered by no event (`cover_by_device_sync`), release some cached memory and retry →
//! release all of it (and finish deferred frees, synchronising) and retry → out of memory.
//!
//! A `Pool` is not thread-safe by itself; `crate::registry` puts each behind a lock (a
//! device has one `Pool` per shard, see there; the shards share one `Budget`).

use crate::block::{Block, Segment};
use crate::config::{LimitSpec, PoolKind};
use crate::debug::AllocRecord;
use crate::decay::Decay;
use crate::pages::Holes;
use crate::trace::{Action, Tracer};
use crate::error::{Error, Result};
use crate::strategy::{self, Strategy};
use crate::stream::{StreamHandle, StreamKey, StreamTracker};
use crate::upstream::{EventHandle, Upstream};
use rustc_hash::FxHashMap;
use attached_caches::AttachedCaches;
pub use attached_caches::{owner_of, Hold, Kind, ThreadCache, FENCE_BATCH, FENCE_BYTES, MAGAZINE, NO_OWNER, WORDS};

mod arena;
mod budget;
mod free;
mod grow;
mod ipc;
mod graph_pools;
mod options;
mod release;
mod reports;
mod snapshot;
mod attached_caches;

pub use arena::ArenaFigures;
pub use budget::Budget;
pub use free::FreeOn;
pub use graph_pools::{routes_active, Callback, Filter, PoolId, C_POOL_TAG, IMPLICIT_POOL_TAG};
pub use options::PoolOptions;

/// Batching of fences for stream-less frees (CuPy): at most this many blocks / bytes wait
/// for one legacy-stream event record, so one record serves many frees, at the price of
/// that much freed memory not yet reusable.
pub const UNFENCED_MAX_BLOCKS: usize = 32;
pub const UNFENCED_MAX_BYTES: usize = 64 << 20;

/// A block handed out and not yet freed.
struct Live {
    block: Block,
    requested: usize,
    /// Streams passed to `record_stream`: the free waits for their work too.
    extra_streams: Vec<StreamHandle>,
    /// Leak-tracking record (`GPUPOOL_DEBUG >= 1`).
    rec: Option<Box<AllocRecord>>,
    /// The thread cache that may hold this block (`NO_OWNER`: none).
    owner: u32,
    /// The stream handle it was allocated for: CuPy's frees name no stream and go there.
    handle: StreamHandle,
    /// The private pool it came from (`graph_pools.rs`), if any.
    private: Option<PoolId>,
}

/// Bytes freed with no record (their stream may be gone) that justify a device-wide wait
/// before the pool grows, at the least (`find_or_grow`).
const UNRECORDED_WAIT_MIN: usize = 64 << 20;

/// A free waiting for `record_stream` streams to pass their recorded events.
struct Pending {
    block: Block,
    events: Vec<EventHandle>,
}

#[derive(Default)]
struct Counters {
    used: usize,
    requested: usize,
    reserved: usize,
    peak_used: usize,
    peak_reserved: usize,
    allocs: u64,
    frees: u64,
    upstream_allocs: u64,
    upstream_frees: u64,
    ooms: u64,
    reclaims: u64,
    reclaimed_bytes: u64,
    invalid_frees: u64,
    deferred_frees: u64,
    /// Page runs recommitted / decommitted (page-mapped upstreams), and their bytes.
    commits: u64,
    decommits: u64,
    commit_bytes: u64,
    upstream_alloc_bytes: u64,
}

pub struct Pool {
    device: i32,
    strategy: Box<dyn Strategy>,
    upstream: Box<dyn Upstream>,
    streams: StreamTracker,
    live: FxHashMap<usize, Live>,
    pending: Vec<Pending>,
    /// Frees from callers without a stream (CuPy) waiting for the next legacy-stream fence.
    unfenced: Vec<Block>,
    unfenced_bytes: usize,
    /// Scratch for the ranges a free leaves pending on its stream (`StreamTracker::on_free`):
    /// kept so a free allocates nothing.
    scratch_ranges: Vec<(usize, usize)>,
    /// `PoolOptions::arena_lend`.
    arena_lend: bool,
    /// Bytes of arena granules the driver unmapped but would not release (`UnmapFail`):
    /// booked unmapped, never handed out again, reported.
    arena_leaked: usize,
    c: Counters,
    /// The device's reserved bytes and their limit, shared with the device's other shards.
    budget: std::sync::Arc<Budget>,
    /// `PoolOptions::shard`.
    shard: u16,
    check: bool,
    debug: u8,
    tracer: Option<&'static Tracer>,
    decay: Option<Decay>,
    /// Pages decommitted inside cached free blocks (page-mapped upstreams only).
    holes: Holes,
    /// Threads' fast-path caches for this pool (`crate::thread_cache`).
    caches: AttachedCaches,
    /// Why the configured strategy is not the one running (arena without VMM), for the
    /// status report.
    notice: Option<String>,
    /// Private pools for CUDA graphs, PyTorch graph pools and `MemPool`s (`graph_pools.rs`).
    graphs: graph_pools::PrivatePools,
    /// Segments the upstream refused to take back (a driver failure while releasing):
    /// still reserved, never handed out, retried at the next release.
    unreleased: Vec<Segment>,
    /// Why this pool stopped, if it did: a panic interrupted one of its operations, so its
    /// books may be wrong and it hands out nothing more (`crate::registry` sets it).
    stopped: Option<String>,
}

impl Pool {
    pub fn new(device: i32, upstream: Box<dyn Upstream>, opts: &PoolOptions) -> Result<Pool> {
        let mut upstream = upstream;
        let limit = match opts.limit {
            None => 0,
            Some(LimitSpec::Bytes(b)) => b,
            Some(spec @ LimitSpec::Percent(_)) => spec.resolve(upstream.mem_info()?.1),
        };
        let budget = opts.budget.clone().unwrap_or_default();
        budget.init_limit(limit);
        let (strategy, notice) = match opts.kind {
            PoolKind::Arena => match arena::build(&mut *upstream, opts.arena_va, opts.arena_chunk) {
                Ok(a) => (a, None),
                Err(why) => (strategy::build(PoolKind::Split), Some(why)),
            },
            kind => (strategy::build(kind), None),
        };
        if let Some(a) = strategy.as_arena_ref() {
            for (base, len) in a.reservations() {
                crate::owners::add(base, len, device, opts.shard);
            }
        }
        // The arena maps granules itself: the page decommit of segment pools stays off.
        let upstream_page = if strategy.as_arena_ref().is_some() { 0 } else { upstream.page_size() };
        Ok(Pool {
            device,
            strategy,
            notice,
            graphs: Default::default(),
            stopped: None,
            unreleased: Vec::new(),
            upstream,
            // `none` gives each free straight back, and that release waits for exactly that
            // free's record: no batching there.
            streams: StreamTracker::new(opts.unsafe_ignore_streams, if opts.kind == PoolKind::None { 1 } else { opts.event_batch }, opts.event_batch_bytes),
            live: FxHashMap::default(),
            pending: Vec::new(),
            unfenced: Vec::new(),
            unfenced_bytes: 0,
            scratch_ranges: Vec::new(),
            arena_lend: opts.arena_lend,
            arena_leaked: 0,
            c: Counters::default(),
            budget,
            shard: opts.shard,
            check: opts.check_invariants,
            debug: opts.debug,
            tracer: opts.tracer,
            decay: Decay::new(opts.decay_window),
            holes: Holes::new(upstream_page),
            caches: AttachedCaches::new(
                // Off where every operation must reach the pool, and in the unsafe test mode
                // (whose point is a pool that reuses at once, the way the cache never does).
                opts.thread_cache
                    && opts.debug == 0
                    && opts.tracer.is_none()
                    && opts.kind != PoolKind::None
                    && !opts.unsafe_ignore_streams
                    && device >= 0,
            ),
        })
    }

    pub fn device(&self) -> i32 {
        self.device
    }

    /// Stop this pool: an operation was interrupted by a panic (caught at the C boundary),
    /// so its books cannot be vouched for. From now on allocations, frees and releases
    /// fail with `Status::Stopped`; reports still work and say why. The memory it holds
    /// stays reserved until the process ends (releasing memory the books may have wrong
    /// could free what a caller still uses).
    pub fn stop(&mut self, why: &str) {
        if self.stopped.is_none() {
            self.stopped = Some(why.to_string());
            self.caches.disable();
        }
    }

    /// Why this pool stopped, if it did.
    pub fn stopped(&self) -> Option<&str> {
        self.stopped.as_deref()
    }

    pub(super) fn running(&self) -> Result<()> {
        match &self.stopped {
            None => Ok(()),
            Some(why) => Err(Error::Stopped(format!(
                "device {}'s pool stopped after an internal error and hands out no more memory ({why}); restart the process",
                self.device
            ))),
        }
    }

    pub fn strategy_name(&self) -> &'static str {
        self.strategy.name()
    }

    pub fn upstream_name(&self) -> &'static str {
        self.upstream.name()
    }

    /// Bytes reserved from the upstream (cheap; `stats()` computes more).
    pub fn reserved_bytes(&self) -> usize {
        self.c.reserved
    }

    /// Bytes in live blocks.
    pub fn used_bytes(&self) -> usize {
        self.c.used
    }

    /// Page runs recommitted and decommitted so far (page-mapped upstreams).
    pub fn page_ops(&self) -> (u64, u64) {
        (self.c.commits, self.c.decommits)
    }

    /// Bytes obtained from the upstream so far: new segments, and pages recommitted.
    pub fn obtained_bytes(&self) -> (u64, u64) {
        (self.c.upstream_alloc_bytes, self.c.commit_bytes)
    }

    /// Live allocations (blocks kept in thread caches were freed by their users).
    pub fn live_count(&self) -> usize {
        self.live.len() - self.caches.kept().len()
    }

    pub fn owns(&self, ptr: usize) -> bool {
        self.live.contains_key(&ptr)
    }

    /// Allocate `size` bytes for use on `stream`. Size 0 gives a null pointer (0).
    pub fn malloc(&mut self, size: usize, stream: StreamHandle) -> Result<usize> {
        self.malloc_owned(size, stream, NO_OWNER)
    }

    /// Enqueue a fence on the legacy stream now: CuPy frees made before it may be reused
    /// (`FreeOn::Unordered`'s rule; the thread caches' magazines batch them). False when no
    /// fence could be recorded nor the legacy stream waited for: nothing proves those frees
    /// safe to reuse, so the caller keeps them unfenced (and tries again later).
    #[must_use]
    pub fn fence_legacy_now(&mut self) -> bool {
        // Mark the legacy stream as freed-on so the fence records, then record it.
        let _ = self.streams.on_free(&mut *self.upstream, StreamKey::LEGACY, crate::stream::STREAM_LEGACY, &[]);
        if self.streams.fence_legacy(&mut *self.upstream).is_ok() {
            return true;
        }
        // Without a fence the blocks cannot be proven safe: wait for the legacy stream
        // instead (a record and a wait on it).
        let allowed = self.device_sync_allowed();
        self.streams.synchronize(&mut *self.upstream, StreamKey::LEGACY, allowed).is_ok()
    }

    /// `malloc` for the cache `owner` (`NO_OWNER`: none), which may then hold the block.
    pub fn malloc_owned(&mut self, size: usize, stream: StreamHandle, owner: u32) -> Result<usize> {
        self.running()?;
        if size == 0 {
            return Ok(0);
        }
        // Private pools first: while one routes, the thread caches step aside (only blocks
        // without a cache owner can be private ones).
        if owner == NO_OWNER && self.graphs.has_routes() {
            if let Some(id) = self.route(stream)? {
                return self.malloc_private(size, stream, id);
            }
        }
        let key = self.streams.key(&mut *self.upstream, stream)?;
        let rounded = match self.strategy.round(size) {
            Some(r) => r,
            None => return Err(self.oom(size, size, false)),
        };
        if !self.pending.is_empty() {
            self.finish_pending(false);
        }
        let mut block = self.find_or_grow(size, rounded, key, stream)?;
        if !self.holes.is_empty() {
            if let Err(e) = self.commit_block(&block) {
                // Back to the cache as it was taken (its pages stay decommitted). A block
                // straddling pages may need more memory than a fresh segment: try one.
                let _ = self.strategy.put(block);
                // Booked under this stream now: it may have been another stream's, which this
                // one waited for; a record here makes later reuse elsewhere wait for both.
                if !self.capturing(stream, false) {
                    let _ = self.streams.record_now(&mut *self.upstream, key, stream);
                }
                block = self.grow(size, rounded, key, stream, false).map_err(|_| e)?;
            }
        }
        // Booked under the requesting stream: a free that names no stream (CuPy) goes there.
        block.stream = key;
        self.c.used += block.size;
        self.c.requested += size;
        if self.c.used > self.c.peak_used {
            // `used` counts blocks kept in thread caches, which their users freed: the
            // peak must not (rarely reached: only when a new peak is possible).
            let kept = if self.caches.enabled() { self.kept_bytes().1 } else { 0 };
            self.c.peak_used = self.c.peak_used.max(self.c.used - kept);
        }
        self.c.allocs += 1;
        let rec = AllocRecord::capture(self.debug, stream);
        self.live.insert(block.addr, Live { block, requested: size, extra_streams: Vec::new(), rec, owner, handle: stream, private: None });
        self.trace(stream, Action::Alloc, block.addr, size);
        if let Some(cap) = self.decay.as_mut().and_then(|d| d.on_malloc(self.c.used)) {
            self.shrink_to(cap);
        }
        self.verify();
        Ok(block.addr)
    }

    #[inline]
    pub(super) fn trace(&self, stream: StreamHandle, action: Action, ptr: usize, size: usize) {
        if let Some(t) = self.tracer {
            t.record(self.device, stream, action, ptr, size);
        }
    }

    /// Give every wholly free cached segment back to the upstream. Returns the bytes.
    pub fn reclaim(&mut self) -> Result<usize> {
        self.running()?;
        if !self.graphs.has_routes() {
            self.release_unused_private_pools();
        }
        // What went back, however it went (deferred frees finishing here release their
        // segments at once under the `none` strategy): the drop in reserved bytes.
        let before = self.c.reserved;
        self.flush_thread_caches(None);
        self.finish_pending(false);
        self.fence_unfenced();
        self.c.reclaims += 1;
        let r = self.release_cached(None).map(|_| {
            let pages = self.decommit_free(usize::MAX);
            self.c.reclaimed_bytes += pages as u64;
            before - self.c.reserved
        });
        self.trace(0, Action::Reclaim, 0, *r.as_ref().unwrap_or(&0));
        self.verify();
        r
    }

    /// Set the device's reserved-bytes cap (0 = none); this pool's cached memory above it
    /// is released now (the registry asks every shard of a sharded device in turn).
    pub fn set_limit(&mut self, bytes: usize) -> Result<()> {
        self.running()?;
        self.budget.set_limit(bytes);
        self.release_over_limit()
    }

    /// Release this pool's cached memory while the device is over its limit.
    pub fn release_over_limit(&mut self) -> Result<()> {
        self.running()?;
        let excess = self.budget.excess();
        if excess != 0 {
            self.flush_thread_caches(None);
            self.release_cached(Some(excess.min(self.c.reserved)))?;
        }
        self.verify();
        Ok(())
    }

    pub fn limit(&self) -> usize {
        self.budget.limit()
    }

    /// The device's budget (shared by its shards).
    pub fn budget(&self) -> &std::sync::Arc<Budget> {
        &self.budget
    }

    /// Which shard of its device this pool is.
    pub fn shard(&self) -> u16 {
        self.shard
    }

    /// Take back the out-of-memory this pool last counted: the registry freed other shards'
    /// cache and the retry succeeded, so the caller never saw it.
    pub fn retract_oom(&mut self) {
        self.c.ooms = self.c.ooms.saturating_sub(1);
    }

    /// Bytes this pool could give back now (cached, or kept in thread caches for their
    /// threads' next allocation): what releasing other shards' cache for a shard out of
    /// memory may gain.
    pub fn cached_bytes(&self) -> usize {
        let kept = if self.caches.enabled() { self.kept_bytes().1 } else { 0 };
        self.c.reserved.saturating_sub(self.c.used - kept)
    }

    /// Device `(free, total)` from the upstream.
    pub fn mem_info(&mut self) -> Result<(usize, usize)> {
        self.upstream.mem_info()
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // Routes of a pool that goes away end with it (the thread caches' bypass counts them).
        let routes = self.graphs.route_count();
        if routes > 0 {
            graph_pools::forget_routes(routes);
        }
        if self.stopped.is_some() {
            return; // books not vouched for: give nothing back (see `stop`)
        }
        // Cached memory goes back; live blocks belong to their owners and are left alone.
        self.finish_pending(true);
        self.fence_unfenced();
        let _ = self.release_cached(None);
        self.release_private_pools();
        self.arena_teardown();
        self.streams.destroy_all(&mut *self.upstream);
    }
}
