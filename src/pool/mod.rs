//! One device's pool: the facade that ties a strategy, an upstream and the stream tracker
//! together, and owns the live-pointer map, the limit, the counters and the OOM escalation.
//!
//! Escalation when a request finds no cached block (PyTorch's order):
//! take cached → flush deferred frees and retry → grow (preferred segment size, then the
//! minimal one) → release some cached segments and retry → release all cached segments
//! (and finish deferred frees, synchronising) and retry → out of memory.
//!
//! A `Pool` is not thread-safe by itself; `registry.rs` puts each behind one lock.

use crate::block::{Block, Segment};
use crate::config::{LimitSpec, PoolKind};
use crate::debug::{AllocRecord, Leak};
use crate::decay::Decay;
use crate::pages::Holes;
use crate::trace::{Action, Tracer};
use crate::error::{BadPointer, Error, OomReport, Result};
use crate::stats::{render_json, render_status, ReportContext, Stats, STATS_VERSION};
use crate::strategy::{self, Strategy};
use crate::stream::{StreamHandle, StreamKey, StreamTracker};
use crate::upstream::{AllocError, EventHandle, Upstream};
use rustc_hash::FxHashMap;
use thread_caches::ThreadCaches;
pub use thread_caches::{owner_of, Hold, Kind, ThreadCache, FENCE_BATCH, FENCE_BYTES, MAGAZINE, NO_OWNER, WORDS};

mod arena;
mod graph_pools;
mod release;
mod snapshot;
mod thread_caches;

pub use graph_pools::{routes_active, Callback, Filter, PoolId, C_POOL_TAG, IMPLICIT_POOL_TAG};

/// Batching of fences for stream-less frees (CuPy): at most this many blocks / bytes wait.
/// A legacy-stream event record costs 0.26–0.52 µs on the H200 (`hotpath_bench`); 32 blocks
/// per fence make it ~10–16 ns per free, at the price of up to 32 blocks (≤ 64 MiB) waiting.
pub const UNFENCED_MAX_BLOCKS: usize = 32;
pub const UNFENCED_MAX_BYTES: usize = 64 << 20;

/// How to build a pool.
#[derive(Clone, Debug)]
pub struct PoolOptions {
    pub kind: PoolKind,
    pub limit: Option<LimitSpec>,
    /// Full invariant scan after every operation (tests).
    pub check_invariants: bool,
    /// TEST ONLY: ignore streams when reusing blocks (see `Config::unsafe_ignore_streams`).
    pub unsafe_ignore_streams: bool,
    /// `GPUPOOL_DEBUG` level (0, 1, 2): what each live allocation records.
    pub debug: u8,
    /// Where events go (`GPUPOOL_TRACE`), if anywhere.
    pub tracer: Option<&'static Tracer>,
    /// `GPUPOOL_DECAY` window in allocations; 0 = keep all cached memory (`decay.rs`).
    pub decay_window: usize,
    /// `GPUPOOL_ARENA_VA`: address space of the arena's large-block range (default: twice
    /// the device's memory).
    pub arena_va: Option<usize>,
    /// `GPUPOOL_THREAD_CACHE`: let threads keep their legacy-stream and CuPy frees for
    /// their next allocation of the same size (`crate::thread_cache`); ignored where every
    /// operation must reach the pool (debug records, trace, the `none` strategy, the unsafe
    /// test mode).
    pub thread_cache: bool,
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            kind: PoolKind::Split,
            limit: None,
            check_invariants: false,
            unsafe_ignore_streams: false,
            debug: 0,
            tracer: None,
            decay_window: crate::decay::DEFAULT_WINDOW,
            arena_va: None,
            thread_cache: true,
        }
    }
}

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
    c: Counters,
    /// Reserved-bytes cap; 0 = none.
    limit: usize,
    check: bool,
    debug: u8,
    tracer: Option<&'static Tracer>,
    decay: Option<Decay>,
    /// Pages decommitted inside cached free blocks (page-mapped upstreams only).
    holes: Holes,
    /// Threads' fast-path caches for this pool (`crate::thread_cache`).
    caches: ThreadCaches,
    /// Why the configured strategy is not the one running (arena without VMM), for the
    /// status report.
    notice: Option<String>,
    /// Private pools for CUDA graphs, PyTorch graph pools and `MemPool`s (`graph_pools.rs`).
    graphs: graph_pools::PrivatePools,
    /// Segments the upstream refused to take back (a driver failure while releasing):
    /// still reserved, never handed out, retried at the next release.
    unreleased: Vec<Segment>,
    /// Why this pool stopped, if it did: a panic interrupted one of its operations, so its
    /// books may be wrong and it hands out nothing more (`registry.rs` sets it).
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
        let (strategy, notice) = match opts.kind {
            PoolKind::Arena => match arena::build(&mut *upstream, opts.arena_va) {
                Ok(a) => (a, None),
                Err(why) => (strategy::build(PoolKind::Split), Some(why)),
            },
            kind => (strategy::build(kind), None),
        };
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
            streams: StreamTracker::new(opts.unsafe_ignore_streams),
            live: FxHashMap::default(),
            pending: Vec::new(),
            unfenced: Vec::new(),
            unfenced_bytes: 0,
            c: Counters::default(),
            limit,
            check: opts.check_invariants,
            debug: opts.debug,
            tracer: opts.tracer,
            decay: Decay::new(opts.decay_window),
            holes: Holes::new(upstream_page),
            caches: ThreadCaches::new(
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

    fn running(&self) -> Result<()> {
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
    /// (`free_unordered`'s rule; the thread caches' magazines batch them).
    pub fn fence_legacy_now(&mut self) {
        // Mark the legacy stream as freed-on so the fence records, then record it.
        let _ = self.streams.on_free(&mut *self.upstream, StreamKey::LEGACY, crate::stream::STREAM_LEGACY);
        if self.streams.fence_legacy(&mut *self.upstream).is_err() {
            // Without a fence the blocks cannot be proven safe: wait for the device instead.
            let _ = self.streams.synchronize(&mut *self.upstream, StreamKey::LEGACY);
        }
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
                block = self.grow(size, rounded, key, stream, false).map_err(|_| e)?;
            }
        }
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

    fn take_cached(&mut self, rounded: usize, key: StreamKey, stream: StreamHandle) -> Option<Block> {
        let (streams, up) = (&mut self.streams, &mut *self.upstream);
        let mut gate = |from: StreamKey| streams.make_safe(up, from, key, stream);
        self.strategy.take(rounded, key, &mut gate)
    }

    fn find_or_grow(&mut self, size: usize, rounded: usize, key: StreamKey, stream: StreamHandle) -> Result<Block> {
        if let Some(b) = self.take_cached(rounded, key, stream) {
            return Ok(b);
        }
        if self.unfenced.len() >= UNFENCED_MAX_BLOCKS || self.unfenced_bytes >= UNFENCED_MAX_BYTES {
            self.fence_unfenced();
            if let Some(b) = self.take_cached(rounded, key, stream) {
                return Ok(b);
            }
        }
        if self.strategy.flush_deferred() {
            if let Some(b) = self.take_cached(rounded, key, stream) {
                return Ok(b);
            }
        }
        // Reusable blocks kept in thread caches before new memory: the fast path never makes
        // the pool grow. (Unfenced CuPy frees could not serve this request; pressure below
        // takes them too.)
        if self.caches.enabled() && self.caches.any_reusable() {
            for (p, hold) in self.caches.take_all_kept(true) {
                self.release_kept(p, hold);
            }
            self.strategy.flush_deferred();
            if let Some(b) = self.take_cached(rounded, key, stream) {
                return Ok(b);
            }
        }
        self.grow(size, rounded, key, stream, true)
    }

    /// Reserve a new segment and carve the block from it, escalating (release some cache,
    /// then all of it) when the upstream or the limit refuses; `retake`: between stages,
    /// try the cache again (false when the cached candidate is known not to fit). The
    /// arena maps a window instead (`arena.rs`).
    fn grow(&mut self, size: usize, rounded: usize, key: StreamKey, stream: StreamHandle, retake: bool) -> Result<Block> {
        if self.strategy.as_arena_ref().is_some() {
            return self.grow_arena(size, rounded, key, stream, retake);
        }
        let preferred = match self.strategy.segment_size(rounded) {
            Some(s) => s,
            None => return Err(self.oom(size, rounded, false)),
        };
        // Escalation: 0 = as is, 1 = after releasing some cache, 2 = after releasing all.
        let mut by_limit = false;
        for stage in 0..3 {
            match stage {
                // A release the driver refuses keeps its segment for later; the request
                // may still be served by what did go back or by the upstream.
                1 => {
                    self.flush_thread_caches();
                    self.fence_unfenced();
                    let _ = self.release_cached(Some(preferred));
                }
                2 => {
                    self.flush_thread_caches();
                    self.fence_unfenced();
                    self.finish_pending(true);
                    let _ = self.release_cached(None);
                }
                _ => {}
            }
            if stage > 0 && retake {
                if let Some(b) = self.take_cached(rounded, key, stream) {
                    return Ok(b);
                }
            }
            // The preferred segment first; when it does not fit, just the request.
            let mut sizes = [preferred, rounded];
            let n = if preferred == rounded { 1 } else { 2 };
            sizes[..n].sort_unstable_by(|a, b| b.cmp(a));
            for &seg_size in &sizes[..n] {
                if stage == 0 {
                    self.decay_before_grow(seg_size);
                }
                if self.over_limit(seg_size) {
                    by_limit = seg_size == rounded;
                    continue;
                }
                match self.upstream.allocate(seg_size, stream) {
                    Ok(base) => {
                        self.trace(stream, Action::UpstreamAlloc, base, seg_size);
                        self.c.reserved += seg_size;
                        self.c.peak_reserved = self.c.peak_reserved.max(self.c.reserved);
                        self.c.upstream_allocs += 1;
                        self.c.upstream_alloc_bytes += seg_size as u64;
                        if key != StreamKey::LEGACY {
                            // Stream-ordered upstreams make the memory valid on `stream` only;
                            // cover it so another stream reusing the remainder waits.
                            let _ = self.streams.on_free(&mut *self.upstream, key, stream);
                        }
                        let seg = Segment { base, size: seg_size, stream: key };
                        return Ok(self.strategy.add_segment(seg, rounded));
                    }
                    Err(AllocError::OutOfMemory) => {
                        by_limit = false;
                    }
                    Err(AllocError::Other(e)) => return Err(e),
                }
            }
        }
        Err(self.oom(size, rounded, by_limit))
    }

    /// Whether reserving `bytes` more would pass the limit (0 = no limit).
    fn over_limit(&self, bytes: usize) -> bool {
        self.limit != 0 && bytes > self.limit.saturating_sub(self.c.reserved)
    }

    fn oom(&mut self, requested: usize, rounded: usize, by_limit: bool) -> Error {
        self.c.ooms += 1;
        self.trace(0, Action::Oom, 0, requested);
        Error::OutOfMemory(Box::new(OomReport {
            device: self.device,
            requested,
            rounded,
            reserved: self.c.reserved,
            in_use: self.c.used,
            cached: self.strategy.cached_bytes() - self.holes.bytes(),
            largest_free_block: self.strategy.largest_free_block(),
            limit: self.limit,
            device_free_total: self.upstream.mem_info().ok(),
            by_limit,
            strategy: self.strategy.name(),
        }))
    }

    #[inline]
    fn trace(&self, stream: StreamHandle, action: Action, ptr: usize, size: usize) {
        if let Some(t) = self.tracer {
            t.record(self.device, stream, action, ptr, size);
        }
    }

    /// Every live allocation, for the leak report.
    pub fn leaks(&self) -> Vec<Leak> {
        let kept = self.caches.kept();
        self.live
            .values()
            .filter(|l| !kept.contains(&l.block.addr))
            .map(|l| Leak::new(self.device, l.block.addr, l.block.size, l.requested, l.rec.as_deref()))
            .collect()
    }

    /// Free `ptr`, last used on `stream`. Freeing null (0) does nothing.
    pub fn free(&mut self, ptr: usize, stream: StreamHandle) -> Result<()> {
        if ptr == 0 {
            return Ok(());
        }
        self.free_checked(ptr, stream, false)
    }

    /// Free `ptr` on the stream it was allocated for (CuPy, which names no stream at free;
    /// CuPy's own pool reuses a block only on its allocation stream, so that stream's order
    /// is the one its users rely on). `check_capture`: ask whether that stream is capturing
    /// a graph even while no private pool routes (CuPy captures nobody announced).
    pub fn free_as_allocated(&mut self, ptr: usize, check_capture: bool) -> Result<()> {
        let Some(handle) = self.live.get(&ptr).map(|l| l.handle) else {
            self.c.invalid_frees += 1;
            return Err(self.classify_bad_pointer(ptr));
        };
        self.free_checked(ptr, handle, check_capture)
    }

    fn free_checked(&mut self, ptr: usize, stream: StreamHandle, check_capture: bool) -> Result<()> {
        self.running()?;
        // Resolve the stream first, so a failure there changes nothing.
        let key = self.streams.key(&mut *self.upstream, stream)?;
        if self.live.get(&ptr).is_some_and(|l| l.private.is_some()) {
            let live = self.take_live(ptr, stream)?;
            let block = Block { stream: key, ..live.block };
            let r = self.free_private(block, live.private.expect("checked"));
            self.verify();
            return r;
        }
        let capturing = self.capturing(stream, check_capture);
        let live = self.take_live(ptr, stream)?;
        let block = Block { stream: key, ..live.block };
        if capturing {
            // An event recorded on a capturing stream belongs to the graph: record none, and
            // keep the stream's blocks on it until a later free covers them.
            self.streams.on_free_capturing(&mut *self.upstream, key, stream);
        } else {
            // A failed event record leaves the stream uncovered: its blocks then simply are
            // not reused across streams (make_safe says no). The free itself succeeds.
            let _ = self.streams.on_free(&mut *self.upstream, key, stream);
        }
        let mut events = Vec::new();
        if !self.streams.ignores_streams() {
            for &h in &live.extra_streams {
                match self.streams.record_on(&mut *self.upstream, h) {
                    Ok(ev) => events.push(ev),
                    // No event can say when that stream's work is done: wait for the
                    // device now rather than hand the block out early.
                    Err(_) => {
                        if let Err(e) = self.upstream.synchronize_device() {
                            for ev in events {
                                self.streams.recycle(ev);
                            }
                            self.restore_live(ptr, live);
                            return Err(e);
                        }
                    }
                }
            }
        }
        let result = if events.is_empty() {
            self.put_block(block)
        } else {
            self.c.deferred_frees += 1;
            self.pending.push(Pending { block, events });
            Ok(())
        };
        self.verify();
        result
    }

    fn put_block(&mut self, block: Block) -> Result<()> {
        match self.strategy.put(block) {
            // Not cached (passthrough): straight back. A stream-ordered upstream orders the
            // release on the freeing stream; any other first waits for that stream's work
            // (cuMemFree happens to synchronise by itself, cuMemUnmap does not).
            Some(seg) => {
                let r = if self.upstream.stream_ordered() { self.give_to_upstream(seg) } else { self.release_segment(seg) };
                // A refused release keeps the segment (reserved, unusable) for a later retry:
                // the free itself succeeded.
                if r.is_err() {
                    self.unreleased.push(seg);
                }
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// Move deferred frees whose events completed (all of them, waiting, if `wait`).
    fn finish_pending(&mut self, wait: bool) {
        let mut i = 0;
        while i < self.pending.len() {
            let done = self.pending[i].events.iter().all(|&ev| {
                if wait {
                    self.upstream.event_synchronize(ev).is_ok()
                } else {
                    self.upstream.event_query(ev).unwrap_or(false)
                }
            });
            if done {
                let p = self.pending.swap_remove(i);
                for ev in p.events {
                    self.streams.recycle(ev);
                }
                let _ = self.put_block(p.block);
            } else {
                i += 1;
            }
        }
    }

    fn classify_bad_pointer(&self, ptr: usize) -> Error {
        let why = if self.strategy.is_free_block(ptr)
            || self.graphs.is_free_block(ptr)
            || self.live.get(&ptr).is_some_and(|l| l.owner != NO_OWNER && self.caches.is_kept(l.owner, ptr))
            || self.pending.iter().any(|p| p.block.addr == ptr)
            || self.unfenced.iter().any(|b| b.addr == ptr)
        {
            BadPointer::AlreadyFreed
        } else if let Some(l) = self.live.values().find(|l| l.block.addr < ptr && ptr < l.block.end()) {
            BadPointer::Interior { block_start: l.block.addr, block_size: l.block.size }
        } else {
            BadPointer::Unknown
        };
        Error::InvalidPointer { ptr, device: self.device, why }
    }

    /// Remove `ptr` from the live map for a free on `stream` (counted and traced); an
    /// unknown pointer is counted as an invalid free and changes nothing else.
    fn take_live(&mut self, ptr: usize, stream: StreamHandle) -> Result<Live> {
        let Some(live) = self.live.remove(&ptr) else {
            self.c.invalid_frees += 1;
            return Err(self.classify_bad_pointer(ptr));
        };
        if live.owner != NO_OWNER && self.caches.claim(live.owner, ptr).is_some_and(|h| h != Hold::Handed) {
            // Its thread freed it already and keeps it for reuse: a double free.
            self.live.insert(ptr, live);
            self.c.invalid_frees += 1;
            return Err(Error::InvalidPointer { ptr, device: self.device, why: BadPointer::AlreadyFreed });
        }
        self.trace(stream, Action::Free, ptr, live.requested);
        self.c.used -= live.block.size;
        self.c.requested -= live.requested;
        self.c.frees += 1;
        Ok(live)
    }

    /// Undo `take_live` for a free that could not finish (nothing about the block changed).
    fn restore_live(&mut self, ptr: usize, live: Live) {
        self.c.used += live.block.size;
        self.c.requested += live.requested;
        self.c.frees -= 1;
        self.live.insert(ptr, live);
    }

    /// The free of `ptr` will also wait for work queued on `stream` until the free.
    pub fn record_stream(&mut self, ptr: usize, stream: StreamHandle) -> Result<()> {
        self.running()?;
        let Some(l) = self.live.get_mut(&ptr) else {
            return Err(self.classify_bad_pointer(ptr));
        };
        // Its free must now reach the pool (which waits for `stream`): off the fast path.
        if l.owner != NO_OWNER && self.caches.claim(l.owner, ptr).is_some_and(|h| h != Hold::Handed) {
            return Err(Error::InvalidPointer { ptr, device: self.device, why: BadPointer::AlreadyFreed });
        }
        if !l.extra_streams.contains(&stream) {
            l.extra_streams.push(stream);
        }
        Ok(())
    }

    /// The upstream allocation that holds the live block at `ptr`: `(base, size)`.
    pub fn segment_of(&self, ptr: usize) -> Result<(usize, usize)> {
        let Some(l) = self.live.get(&ptr) else {
            return Err(self.classify_bad_pointer(ptr));
        };
        if self.strategy.as_arena_ref().is_some() {
            // The arena has no upstream allocations per block: the block is its own range.
            return Ok((l.block.addr, l.block.size));
        }
        let base = l.block.segment;
        Ok((base, self.strategy.segment_len(base).unwrap_or(l.block.size)))
    }

    /// Free for a caller that cannot name its stream (CuPy). The block becomes reusable
    /// after the next fence (an event record) on the legacy default stream: work issued
    /// later on any blocking stream waits for legacy-stream work, which waited for all
    /// earlier work on blocking streams. Fences are batched: they
    /// cost about a microsecond each, so up to `UNFENCED_MAX_BLOCKS` blocks /
    /// `UNFENCED_MAX_BYTES` wait for one; meanwhile requests are served from fenced cache
    /// or new memory, never from unfenced blocks. Pressure (limit, OOM, reclaim) fences at once.
    pub fn free_unordered(&mut self, ptr: usize) -> Result<()> {
        self.running()?;
        if self.streams.ignores_streams() {
            return self.free(ptr, crate::stream::STREAM_LEGACY);
        }
        if ptr == 0 {
            return Ok(());
        }
        let live = self.take_live(ptr, crate::stream::STREAM_LEGACY)?;
        let block = Block { stream: StreamKey::LEGACY, ..live.block };
        self.unfenced_bytes += block.size;
        self.unfenced.push(block);
        if self.unfenced.len() >= UNFENCED_MAX_BLOCKS || self.unfenced_bytes >= UNFENCED_MAX_BYTES {
            self.fence_unfenced();
        }
        self.verify();
        Ok(())
    }

    /// Fence the legacy stream and hand every unfenced block to the strategy.
    fn fence_unfenced(&mut self) {
        if self.unfenced.is_empty() {
            return;
        }
        self.fence_legacy_now();
        self.unfenced_bytes = 0;
        for b in std::mem::take(&mut self.unfenced) {
            let _ = self.put_block(b);
        }
    }

    /// Give every wholly free cached segment back to the upstream. Returns the bytes.
    pub fn reclaim(&mut self) -> Result<usize> {
        self.running()?;
        // What went back, however it went (deferred frees finishing here release their
        // segments at once under the `none` strategy): the drop in reserved bytes.
        let before = self.c.reserved;
        self.flush_thread_caches();
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

    /// Set the reserved-bytes cap (0 = none); cached memory above it is released now.
    pub fn set_limit(&mut self, bytes: usize) -> Result<()> {
        self.running()?;
        self.limit = bytes;
        if bytes != 0 && self.c.reserved > bytes {
            self.flush_thread_caches();
            self.release_cached(Some(self.c.reserved - bytes))?;
        }
        self.verify();
        Ok(())
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Device `(free, total)` from the upstream.
    pub fn mem_info(&mut self) -> Result<(usize, usize)> {
        self.upstream.mem_info()
    }

    pub fn stats(&mut self) -> Stats {
        let (dev_free, dev_total) = self.upstream.mem_info().unwrap_or((0, 0));
        // Blocks kept in thread caches count as freed (their users freed them), and the
        // fast path's operations as operations.
        let (n_kept, kept, kept_requested) = self.kept_bytes();
        let (fast_allocs, fast_frees) = self.caches.fast_counts();
        let used = self.c.used - kept;
        Stats {
            struct_size: std::mem::size_of::<Stats>() as u32,
            version: STATS_VERSION,
            used_bytes: used as u64,
            free_bytes: (self.c.reserved - used) as u64,
            total_bytes: self.c.reserved as u64,
            n_free_blocks: (self.strategy.free_block_count() + n_kept) as u64,
            n_live_blocks: (self.live.len() - n_kept) as u64,
            requested_bytes: (self.c.requested - kept_requested) as u64,
            peak_used_bytes: self.c.peak_used as u64,
            peak_total_bytes: self.c.peak_reserved as u64,
            n_allocs: self.c.allocs + fast_allocs,
            n_frees: self.c.frees + fast_frees,
            n_upstream_allocs: self.c.upstream_allocs,
            n_upstream_frees: self.c.upstream_frees,
            n_ooms: self.c.ooms,
            n_reclaims: self.c.reclaims,
            reclaimed_bytes: self.c.reclaimed_bytes,
            n_invalid_frees: self.c.invalid_frees,
            limit_bytes: self.limit as u64,
            largest_free_block: self.strategy.largest_free_block().max(self.pending.iter().map(|p| p.block.size).max().unwrap_or(0))
                as u64,
            device_free_bytes: dev_free as u64,
            device_total_bytes: dev_total as u64,
            n_cross_stream_reuses: self.streams.cross_stream_waits + self.streams.cross_stream_ready,
            n_deferred_frees: self.c.deferred_frees,
        }
    }

    pub fn memory_status(&mut self) -> String {
        let s = self.stats();
        let mut out = render_status(&self.report_context(), &s);
        if let Some(why) = &self.stopped {
            out.push_str(&format!("  STOPPED: this pool hands out no more memory after an internal error: {why}\n"));
        }
        if let Some(n) = &self.notice {
            out.push_str(&format!("  Notice: {n}\n"));
        }
        let (n, reserved, free) = self.private_pool_summary();
        if n > 0 {
            out.push_str(&format!(
                "  Private pools (CUDA graphs, MemPools): {n}, holding {} ({} of it free, kept for their graphs)\n",
                crate::error::human_bytes(reserved),
                crate::error::human_bytes(free)
            ));
        }
        if let Some((_, text)) = self.arena_report() {
            out.push_str(&text);
            out.push('\n');
        }
        out.push_str(&format!("  Driver calls: {}\n", self.upstream.driver_calls().text()));
        out
    }

    pub fn stats_json(&mut self) -> String {
        let s = self.stats();
        let mut out = render_json(&self.report_context(), &s);
        out.pop(); // the closing brace: the pool's own fields follow
        out.push_str(&format!(",\"driver_calls\":{}", self.upstream.driver_calls().json()));
        if let Some((json, _)) = self.arena_report() {
            out.push_str(&format!(",\"arena\":{json}"));
        }
        if let Some(n) = &self.notice {
            out.push_str(&format!(",\"notice\":\"{}\"", n.replace('\\', "\\\\").replace('"', "\\\"")));
        }
        if let Some(why) = &self.stopped {
            out.push_str(&format!(",\"stopped\":\"{}\"", why.replace('\\', "\\\\").replace('"', "\\\"")));
        }
        let (n, reserved, free) = self.private_pool_summary();
        out.push_str(&format!(",\"private_pools\":{{\"count\":{n},\"reserved_bytes\":{reserved},\"free_bytes\":{free}}}"));
        out.push('}');
        out
    }

    /// Driver calls made by this pool's upstream so far, by kind.
    pub fn driver_calls(&self) -> crate::upstream::DriverCalls {
        self.upstream.driver_calls()
    }

    /// Why the configured strategy is not running, if it is not (arena without VMM).
    pub fn notice(&self) -> Option<&str> {
        self.notice.as_deref()
    }

    /// The arena's counters, for arena pools.
    pub fn arena_counters(&self) -> Option<crate::strategy::arena::ArenaCounters> {
        self.strategy.as_arena_ref().map(|a| a.counters)
    }

    fn report_context(&self) -> ReportContext<'static> {
        ReportContext { device: self.device, strategy: self.strategy.name(), upstream: self.upstream.name() }
    }

    /// Cached free blocks (tests and reports).
    pub fn free_blocks(&self) -> Vec<Block> {
        self.strategy.free_blocks()
    }

    /// Full consistency check of the pool and its strategy.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.strategy.check_invariants()?;
        self.graphs.check_invariants()?;
        let live_bytes: usize = self.live.values().map(|l| l.block.size).sum();
        if live_bytes != self.c.used {
            return Err(format!("used {} but live blocks hold {live_bytes}", self.c.used));
        }
        let pending: usize = self.pending.iter().map(|p| p.block.size).sum::<usize>()
            + self.unfenced_bytes
            + self.unreleased.iter().map(|s| s.size).sum::<usize>();
        if self.unfenced_bytes != self.unfenced.iter().map(|b| b.size).sum::<usize>() {
            return Err("unfenced byte count drifted".into());
        }
        let cached = self.strategy.cached_bytes() + self.graphs.cached_bytes();
        if self.c.used + cached + pending != self.c.reserved + self.holes.bytes() {
            return Err(format!(
                "used {} + cached {} + pending {pending} != reserved {} + decommitted {}",
                self.c.used,
                cached,
                self.c.reserved,
                self.holes.bytes()
            ));
        }
        let in_holes = |b: &Block| !self.holes.missing_runs(b.segment, b.addr, b.size).is_empty();
        if let Some(l) = self.live.values().find(|l| in_holes(&l.block)) {
            return Err(format!("live block {:?} overlaps decommitted pages", l.block));
        }
        if let Some(p) = self.pending.iter().find(|p| in_holes(&p.block)) {
            return Err(format!("deferred block {:?} overlaps decommitted pages", p.block));
        }
        let mut spans: Vec<(usize, usize, bool)> = self.live.values().map(|l| (l.block.addr, l.block.end(), true)).collect();
        spans.extend(self.strategy.free_blocks().iter().map(|b| (b.addr, b.end(), false)));
        spans.extend(self.graphs.free_blocks().iter().map(|b| (b.addr, b.end(), false)));
        spans.extend(self.pending.iter().map(|p| (p.block.addr, p.block.end(), true)));
        spans.extend(self.unfenced.iter().map(|b| (b.addr, b.end(), true)));
        spans.sort_unstable();
        for w in spans.windows(2) {
            if w[0].1 > w[1].0 {
                return Err(format!("blocks overlap: {:#x}..{:#x} and {:#x}..{:#x}", w[0].0, w[0].1, w[1].0, w[1].1));
            }
        }
        for l in self.live.values() {
            if l.block.addr % crate::block::MIN_ALIGN != 0 || l.requested > l.block.size {
                return Err(format!("live block {:?} misaligned or short of {}", l.block, l.requested));
            }
        }
        // A thread cache holds only live blocks recorded as its own (a snapshot: owners
        // change HANDED <-> PARKED concurrently, never the pointer).
        for (id, p, how) in self.caches.held() {
            if !self.live.get(&p).is_some_and(|l| l.owner == id) {
                return Err(format!("thread cache {id} holds {p:#x} ({how:?}), which is not its live block"));
            }
        }
        Ok(())
    }

    fn verify(&self) {
        if self.check {
            if let Err(e) = self.check_invariants() {
                panic!("gpupool invariant violated on device {}: {e}", self.device);
            }
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
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
