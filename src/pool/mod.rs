//! One device's pool (`Pool`): a core allocator with layers around it, the way RMM wraps a
//! resource in adaptors. Each part is a type with one job, in its own file:
//!
//! ```text
//! thread caches (crate::thread_cache)  ->  graph-pool routing (graph_pools.rs)
//!     ->  limits (limits.rs: budget, decay)  ->  core (core.rs: strategy + upstream
//!     + stream tracker + live map)  ->  upstream
//! recording on the side (recorder.rs: counters, trace, leak records)
//! ```
//!
//! `Pool` holds the core and the layers as fields, and of its own only whether it stopped
//! and whether it is paused (a tag's pool, `pause.rs`), with the books of its sharing
//! (`crate::share`'s types: kept imports, exported blocks). Its operations are where the
//! layers meet, so they are `Pool` methods, grouped by concern: allocation (and a thread's
//! cache attaching on it), limits, reclaim and the pool's lifetime here; frees (one entry
//! point, `Pool::free`, told by `FreeOn` what is known of the stream; the thread caches'
//! kept blocks coming back) in `free.rs`; finding memory, the out-of-memory escalation and
//! both growth paths (segments; the arena's windows and stitches) in `grow.rs`, over the
//! terms in `growth.rs`; giving memory back in `release.rs`; pausing in `pause.rs`; the
//! routing layer's operations in `graph_pools/operations.rs`; exports to other processes
//! and the one hook for imports in `ipc.rs`; reports in `reports.rs`. What needs a layer or
//! two alone is a function of them: a snapshot's segments (`snapshot.rs`), and of the core,
//! the arena's figures and an export's granules with their driver calls (`arena/`). How a
//! pool is built: `options.rs`; the budget a device's shards share: `budget.rs`, and whether
//! their growths contend for the driver: `contention.rs`.
//!
//! Escalation when a request finds no cached block (PyTorch's order):
//! take cached → flush deferred frees and retry → grow (preferred segment size, then the
//! minimal one; the arena maps a window) → wait for the whole device if some stream's frees
//! are covered by no event (`cover_by_device_sync`), release some cached memory and retry →
//! release all of it (and finish deferred frees, synchronising) and retry → out of memory.
//!
//! A `Pool` is not thread-safe by itself; `crate::registry` puts each behind a lock (a
//! device has one `Pool` per shard, see there; the shards share one `Budget`).

use crate::trace::Action;
use crate::error::{Error, Result};
use crate::stream::StreamHandle;
use crate::upstream::Upstream;
use crate::thread_cache::state::{AttachedCaches, ThreadCache, WordState, NO_OWNER};
use std::sync::Arc;
use self::core::{Core, Live};
use limits::Limits;
pub use limits::within_device;
use recorder::Recorder;

mod arena;
mod budget;
mod contention;
mod core;
mod free;
mod graph_pools;
mod grow;
mod growth;

mod ipc;
mod limits;
mod options;
mod pause;
mod recorder;
mod release;
mod reports;
mod snapshot;

pub use arena::ArenaFigures;
pub use budget::Budget;
pub use free::FreeOn;
pub use graph_pools::{routes_active, Callback, Filter, PoolId, C_POOL_TAG, IMPLICIT_POOL_TAG};
pub use options::PoolOptions;

pub use self::core::{UNFENCED_MAX_BLOCKS, UNFENCED_MAX_BYTES};
// A thread's magazine waits for at most half of it (`thread_cache::state::FENCE_BYTES`).
const _: () = assert!(crate::thread_cache::state::FENCE_BYTES * 2 == UNFENCED_MAX_BYTES);

/// Bytes freed with no record (their stream may be gone) that justify a device-wide wait
/// before the pool grows, at the least (`find_or_grow`).
const UNRECORDED_WAIT_MIN: usize = 64 << 20;

/// One device's pool: the core allocator and the layers around it (module docs).
pub struct Pool {
    /// Strategy, upstream, stream tracker and live map (`core.rs`).
    core: Core,
    /// The device's budget and this pool's decay: who may reserve how much (`limits.rs`).
    limits: Limits,
    /// Counters, trace and leak records (`recorder.rs`).
    rec: Recorder,
    /// Private pools for CUDA graphs, PyTorch graph pools and `MemPool`s, and the routes
    /// to them (`graph_pools.rs`).
    graphs: graph_pools::PrivatePools,
    /// Threads' fast-path caches for this pool (`crate::thread_cache`; their blocks come
    /// back through `free.rs`).
    caches: AttachedCaches,
    /// Other processes' memory kept mapped between their messages (`import_cache.rs`).
    imports: crate::share::import_cache::ImportCache,
    /// Where this pool's exported blocks' exports are recorded (`ipc.rs`), ended when a
    /// block is freed (`free.rs`).
    exports: crate::share::exports::BlockExports,
    /// Why this pool stopped, if it did: a panic interrupted one of its operations, so its
    /// books may be wrong and it hands out nothing more (`crate::registry` sets it).
    stopped: Option<String>,
    /// Its memory given back while its addresses stay reserved (`pause.rs`).
    paused: Option<pause::Paused>,
}

impl Pool {
    pub fn new(device: i32, mut upstream: Box<dyn Upstream>, opts: &PoolOptions) -> Result<Pool> {
        let limits = Limits::new(opts, &mut *upstream)?;
        let core = Core::new(device, upstream, opts);
        // Only an arena's upstream maps virtual memory (an arena that fell back has none).
        let graphs = graph_pools::PrivatePools::new(opts.private_pools_mapped && core.is_arena());
        Ok(Pool {
            core,
            limits,
            rec: Recorder::new(opts),
            graphs,
            caches: AttachedCaches::new(opts.wants_thread_caches(device)),
            imports: Default::default(),
            exports: Default::default(),
            stopped: None,
            paused: None,
        })
    }

    pub(crate) fn device(&self) -> i32 {
        self.core.device()
    }

    /// Stop this pool: an operation was interrupted by a panic (caught at the C boundary),
    /// so its books cannot be vouched for. From now on allocations, frees and releases
    /// fail with `Status::Stopped`; reports still work and say why. The memory it holds
    /// stays reserved until the process ends (releasing memory the books may have wrong
    /// could free what a caller still uses).
    pub(crate) fn stop(&mut self, why: &str) {
        if self.stopped.is_none() {
            self.stopped = Some(why.to_string());
            self.caches.disable();
        }
    }

    pub(super) fn running(&self) -> Result<()> {
        match &self.stopped {
            None => Ok(()),
            Some(why) => Err(Error::Stopped(format!(
                "device {}'s pool stopped after an internal error and hands out no more memory ({why}); restart the process",
                self.core.device()
            ))),
        }
    }

    pub fn strategy_name(&self) -> &'static str {
        self.core.strategy().name()
    }

    pub(crate) fn upstream_name(&self) -> &'static str {
        self.core.upstream().name()
    }

    /// Bytes reserved from the upstream (cheap; `stats()` computes more).
    pub fn reserved_bytes(&self) -> usize {
        self.rec.c.reserved
    }

    /// Raise the peaks of bytes in use and requested to what is live now. `used` and
    /// `requested` count blocks kept in thread caches, which their users freed: the peaks
    /// must not (the scan of the caches runs only when a new peak is possible).
    pub(super) fn bump_peaks(&mut self) {
        if self.rec.c.used > self.rec.c.peak_used || self.rec.c.requested > self.rec.c.peak_requested {
            let (_, kept, kept_requested) = if self.caches.enabled() { self.kept_bytes() } else { (0, 0, 0) };
            self.rec.c.peak_used = self.rec.c.peak_used.max(self.rec.c.used - kept);
            self.rec.c.peak_requested = self.rec.c.peak_requested.max(self.rec.c.requested - kept_requested);
        }
    }

    /// Peaks start again from what is in use and reserved now (`gpupool_reset_peak_stats`,
    /// PyTorch's `reset_peak_memory_stats`): blocks kept in thread caches count as freed.
    pub fn reset_peaks(&mut self) {
        let (_, kept, kept_requested) = if self.caches.enabled() { self.kept_bytes() } else { (0, 0, 0) };
        self.rec.c.peak_used = self.rec.c.used - kept;
        self.rec.c.peak_requested = self.rec.c.requested - kept_requested;
        self.rec.c.peak_reserved = self.rec.c.reserved;
    }

    /// Bytes in live blocks.
    pub fn used_bytes(&self) -> usize {
        self.rec.c.used
    }

    /// Page runs recommitted and decommitted so far (page-mapped upstreams).
    pub fn page_ops(&self) -> (u64, u64) {
        (self.rec.c.commits, self.rec.c.decommits)
    }

    /// Bytes obtained from the upstream so far: new segments, and pages recommitted.
    pub(crate) fn obtained_bytes(&self) -> (u64, u64) {
        (self.rec.c.upstream_alloc_bytes, self.rec.c.commit_bytes)
    }

    /// Live allocations (blocks kept in thread caches were freed by their users).
    pub(crate) fn live_count(&self) -> usize {
        self.core.live_count() - self.caches.kept().len()
    }

    pub fn owns(&self, ptr: usize) -> bool {
        self.core.is_live(ptr)
    }

    /// The calling thread's fast-path cache for a locked allocation on `stream`: `current`
    /// is the (pool id, cache id) the thread already has for this device. Exited threads'
    /// caches are emptied first. Returns the cache id to pass to `malloc_owned` (with
    /// `owner_of`), and a new cache for the thread to install, if one was made. `None`: no
    /// fast path here (disabled, or the per-thread default stream).
    pub(crate) fn attach_thread(&mut self, current: Option<(u64, u32)>, stream: StreamHandle) -> Option<(u32, Option<Arc<ThreadCache>>)> {
        if !self.caches.enabled() || stream == crate::stream::STREAM_PER_THREAD {
            return None; // (the per-thread default stream means another stream on each thread)
        }
        if self.caches.has_orphans() {
            for (p, state) in self.caches.reap() {
                self.release_kept(p, state, Some(stream));
            }
        }
        self.caches.attach(current)
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
    pub(crate) fn fence_legacy_now(&mut self) -> bool {
        let allowed = self.device_sync_allowed();
        self.core.fence_legacy(allowed)
    }

    /// `malloc` for the cache `owner` (`NO_OWNER`: none), which may then hold the block.
    pub(crate) fn malloc_owned(&mut self, size: usize, stream: StreamHandle, owner: u32) -> Result<usize> {
        self.running()?;
        self.not_paused()?;
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
        let key = self.core.key(stream)?;
        let rounded = match self.core.strategy().round(size) {
            Some(r) => r,
            None => return Err(self.oom(size, size, false)),
        };
        if self.core.has_deferred() {
            self.finish_pending(false);
        }
        let mut block = self.find_or_grow(size, rounded, key, stream)?;
        if !self.core.holes().is_empty() {
            if let Err(e) = self.commit_block(&block) {
                // Back to the cache as it was taken (its pages stay decommitted). A block
                // straddling pages may need more memory than a fresh segment: try one.
                let _ = self.core.strategy_mut().put(block);
                // Booked under this stream now: it may have been another stream's, which this
                // one waited for; a record here makes later reuse elsewhere wait for both.
                if !self.capturing(stream, false) {
                    let _ = self.core.record_now(key, stream);
                }
                block = self.grow(size, rounded, key, stream, false).map_err(|_| e)?;
            }
        }
        // Booked under the requesting stream: a free that names no stream (CuPy) goes there.
        block.stream = key;
        self.rec.c.used += block.size;
        self.rec.c.requested += size;
        self.bump_peaks();
        self.rec.c.allocs += 1;
        let rec = self.rec.alloc_record(stream);
        self.core.insert_live(Live { block, requested: size, extra_streams: Vec::new(), rec, owner, handle: stream, private: None });
        self.trace(stream, Action::Alloc, block.addr, size);
        // Decay's peak counts what live blocks hold beyond their size: it cannot go back.
        // Asked only where decay is on: no strategy call on the malloc path otherwise.
        let (used, strategy) = (self.rec.c.used, self.core.strategy());
        if let Some(cap) = self.limits.on_malloc(|| used + strategy.held_beyond_blocks()) {
            if self.rec.c.reserved > cap {
                // The trim waits for the streams whose memory it gives back: this one's
                // frees are covered by its event rather than a device-wide wait.
                self.cover_own_frees(key, stream);
            }
            self.shrink_to(cap);
        }
        self.verify();
        Ok(block.addr)
    }

    #[inline]
    pub(super) fn trace(&self, stream: StreamHandle, action: Action, ptr: usize, size: usize) {
        self.rec.trace(self.core.device(), stream, action, ptr, size);
    }

    /// Give every wholly free cached segment back to the upstream. Returns the bytes.
    pub fn reclaim(&mut self) -> Result<usize> {
        self.running()?;
        if !self.graphs.has_routes() {
            self.release_unused_private_pools();
        }
        // What went back, however it went (deferred frees finishing here release their
        // segments at once under the `none` strategy): the drop in reserved bytes.
        let before = self.rec.c.reserved;
        self.flush_thread_caches(None);
        self.finish_pending(false);
        self.fence_unfenced();
        self.rec.c.reclaims += 1;
        self.importer().drop_all();
        let r = self.release_cached(None).map(|_| {
            let pages = self.decommit_free(usize::MAX);
            self.rec.c.reclaimed_bytes += pages as u64;
            before - self.rec.c.reserved
        });
        self.trace(0, Action::Reclaim, 0, *r.as_ref().unwrap_or(&0));
        self.verify();
        r
    }

    /// Set the device's reserved-bytes cap (0 = none); this pool's cached memory above it
    /// is released now (the registry asks every shard of a sharded device in turn).
    pub fn set_limit(&mut self, bytes: usize) -> Result<()> {
        self.running()?;
        self.limits.set_limit(bytes);
        self.release_over_limit()
    }

    /// Release this pool's cached memory while the device is over its limit.
    pub(crate) fn release_over_limit(&mut self) -> Result<()> {
        self.running()?;
        let excess = self.limits.excess();
        if excess != 0 {
            self.flush_thread_caches(None);
            self.release_cached(Some(excess.min(self.rec.c.reserved)))?;
        }
        self.verify();
        Ok(())
    }

    /// The device's budget (shared by its shards).
    pub fn budget(&self) -> &std::sync::Arc<Budget> {
        self.limits.budget()
    }

    /// Which shard of its device this pool is.
    pub(crate) fn shard(&self) -> u16 {
        self.core.shard()
    }

    /// Take back the out-of-memory this pool last counted: the registry freed other shards'
    /// cache and the retry succeeded, so the caller never saw it.
    pub(crate) fn retract_oom(&mut self) {
        self.rec.c.ooms = self.rec.c.ooms.saturating_sub(1);
    }

    /// Bytes this pool could give back now (cached, or kept in thread caches for their
    /// threads' next allocation): what releasing other shards' cache for a shard out of
    /// memory may gain.
    pub fn cached_bytes(&self) -> usize {
        let kept = if self.caches.enabled() { self.kept_bytes().1 } else { 0 };
        self.rec.c.reserved.saturating_sub(self.rec.c.used - kept + self.core.strategy().held_beyond_blocks())
    }

    /// Device `(free, total)` from the upstream.
    pub fn mem_info(&mut self) -> Result<(usize, usize)> {
        self.core.upstream_mut().mem_info()
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // Routes of a pool that goes away end with it (the thread caches' bypass counts them).
        let routes = self.graphs.route_count();
        if routes > 0 {
            graph_pools::forget_routes(self.core.device(), routes);
            self.limits.budget().routes_ended(routes);
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
        self.core.destroy_streams();
    }
}
