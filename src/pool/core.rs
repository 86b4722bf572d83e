//! The core allocator of one device's pool (`Core`): the strategy that keeps the cache's
//! books, the upstream that gives and takes memory, the stream tracker that says when a
//! freed block is safe for another stream, and the live map of blocks handed out. With them
//! comes what cannot be separated from them: frees not yet reusable (deferred by
//! `record_stream`, or waiting for a legacy-stream fence), the decommitted pages inside
//! cached blocks, and segments the upstream refused to take back.
//!
//! The core knows nothing of limits, counters, traces, graph pools or thread caches: those
//! are the layers `Pool` puts around it (`mod.rs`). Its methods are the steps that need the
//! core alone; an operation that also asks a layer (a budget claim, a counter, a capture
//! check) is a `Pool` method that calls them.

use crate::block::{Block, Segment};
use crate::config::PoolKind;
use crate::debug::AllocRecord;
use crate::error::Result;
use crate::pages::Holes;
use crate::strategy::arena::ArenaStrategy;
use crate::strategy::{self, Strategy};
use crate::stream::{StreamHandle, StreamKey, StreamTracker};
use crate::upstream::{EventHandle, Upstream};
use rustc_hash::FxHashMap;

use super::options::PoolOptions;

/// A private pool's id (Note [Graph pools]): PyTorch's `MempoolId_t` pair, or a C pool's
/// id and tag. A live block records the private pool it came from.
pub type PoolId = (u64, u64);

/// Batching of fences for stream-less frees (CuPy): at most this many blocks / bytes wait
/// for one legacy-stream event record, so one record serves many frees, at the price of
/// that much freed memory not yet reusable.
pub const UNFENCED_MAX_BLOCKS: usize = 32;
pub const UNFENCED_MAX_BYTES: usize = 64 << 20;

mod arena_space;
mod books;
mod streams;

/// A block handed out and not yet freed.
pub(super) struct Live {
    pub block: Block,
    pub requested: usize,
    /// Streams passed to `record_stream`: the free waits for their work too.
    pub extra_streams: Vec<StreamHandle>,
    /// Leak-tracking record (`GPUPOOL_DEBUG >= 1`).
    pub rec: Option<Box<AllocRecord>>,
    /// The thread cache that may hold this block (`NO_OWNER`: none).
    pub owner: u32,
    /// The stream handle it was allocated for: CuPy's frees name no stream and go there.
    pub handle: StreamHandle,
    /// The private pool it came from (`graph_pools.rs`), if any.
    pub private: Option<PoolId>,
}

/// A free waiting for `record_stream` streams to pass their recorded events.
struct Pending {
    block: Block,
    events: Vec<EventHandle>,
}

/// A pool's strategy: the arena, which grows by mapping granules (the pool's driver calls
/// for it: growth in `grow.rs`, release in `release.rs`, export in `ipc.rs` and
/// `arena/export.rs`), or a strategy that
/// grows by segments. As a `Strategy` both are the same (`Deref`); the arena's own calls
/// are reached by matching, not by asking a strategy what it is.
pub(super) enum PoolStrategy {
    Arena(Box<ArenaStrategy>),
    Segments(Box<dyn Strategy>),
}

impl std::ops::Deref for PoolStrategy {
    type Target = dyn Strategy;
    #[inline]
    fn deref(&self) -> &(dyn Strategy + 'static) {
        match self {
            PoolStrategy::Arena(a) => &**a,
            PoolStrategy::Segments(s) => &**s,
        }
    }
}

impl std::ops::DerefMut for PoolStrategy {
    #[inline]
    fn deref_mut(&mut self) -> &mut (dyn Strategy + 'static) {
        match self {
            PoolStrategy::Arena(a) => &mut **a,
            PoolStrategy::Segments(s) => &mut **s,
        }
    }
}

/// The core allocator (module docs). Its fields are its own: the pool's layers reach them
/// through its methods, so an operation that needs two of them at once (a stream wait
/// through the upstream, a decommit and its holes, a release and the address index) is one
/// place, here (`core/streams.rs`, `core/books.rs`).
pub(super) struct Core {
    device: i32,
    /// `PoolOptions::shard`: the address index (`crate::owners`) names it.
    shard: u16,
    strategy: PoolStrategy,
    upstream: Box<dyn Upstream>,
    streams: StreamTracker,
    /// Blocks handed out, by address.
    live: FxHashMap<usize, Live>,
    /// Frees waiting for the events of the streams `record_stream` named.
    pending: Vec<Pending>,
    /// Frees from callers without a stream (CuPy) waiting for the next legacy-stream fence.
    unfenced: Vec<Block>,
    unfenced_bytes: usize,
    /// Scratch for the ranges a free leaves pending on its stream (`StreamTracker::on_free`):
    /// kept so a free allocates nothing.
    scratch_ranges: Vec<(usize, usize)>,
    /// Pages decommitted inside cached free blocks (page-mapped upstreams only).
    holes: Holes,
    /// Segments the upstream refused to take back (a driver failure while releasing):
    /// still reserved, never handed out, retried at the next release.
    unreleased: Vec<Segment>,
    /// `PoolOptions::arena_lend`.
    arena_lend: bool,
    /// Bytes of arena granules the driver unmapped but would not release (`UnmapFail`):
    /// booked unmapped, never handed out again, reported.
    arena_leaked: usize,
    /// Why the configured strategy is not the one running (arena without VMM), for the
    /// status report.
    notice: Option<String>,
}

impl Core {
    /// Build the strategy `opts` names over `upstream` (the arena reserves its address
    /// space here; without VMM it falls back to `split` and says why in `notice`).
    pub fn new(device: i32, mut upstream: Box<dyn Upstream>, opts: &PoolOptions) -> Core {
        let (strategy, notice) = match opts.kind {
            PoolKind::Arena => match arena_space::build(&mut *upstream, opts) {
                Ok(a) => {
                    for (base, len) in a.reservations() {
                        crate::owners::add(base, len, device, opts.shard);
                    }
                    (PoolStrategy::Arena(a), None)
                }
                Err(why) => (PoolStrategy::Segments(strategy::build(PoolKind::Split)), Some(why)),
            },
            kind => (PoolStrategy::Segments(strategy::build(kind)), None),
        };
        // The arena maps granules itself: the page decommit of segment pools stays off.
        let upstream_page = match strategy {
            PoolStrategy::Arena(_) => 0,
            PoolStrategy::Segments(_) => upstream.page_size(),
        };
        // `none` gives each free straight back, and that release waits for exactly that
        // free's record: no batching there.
        let batch = if opts.kind == PoolKind::None { 1 } else { opts.event_batch };
        Core {
            device,
            shard: opts.shard,
            strategy,
            upstream,
            streams: StreamTracker::new(opts.unsafe_ignore_streams, batch, opts.event_batch_bytes),
            live: FxHashMap::default(),
            pending: Vec::new(),
            unfenced: Vec::new(),
            unfenced_bytes: 0,
            scratch_ranges: Vec::new(),
            holes: Holes::new(upstream_page),
            unreleased: Vec::new(),
            arena_lend: opts.arena_lend,
            arena_leaked: 0,
            notice,
        }
    }

    /// Whether the strategy is the arena (which maps granules rather than reserving
    /// segments).
    #[inline]
    pub fn is_arena(&self) -> bool {
        matches!(self.strategy, PoolStrategy::Arena(_))
    }

    /// The tracker's identity for `stream`.
    #[inline]
    pub fn key(&mut self, stream: StreamHandle) -> Result<StreamKey> {
        self.streams.key(&mut *self.upstream, stream)
    }

    /// Run `f` on the strategy with the reuse gate of a request on `stream` (`key`): free
    /// memory last used on another stream serves it only where `StreamTracker::make_safe`
    /// makes it safe for this one.
    #[inline]
    pub fn with_gate<R>(&mut self, key: StreamKey, stream: StreamHandle, f: impl FnOnce(&mut dyn Strategy, &mut dyn FnMut(StreamKey, usize, usize) -> bool) -> R) -> R {
        let mut gate = self.streams.reuse_gate(&mut *self.upstream, key, stream);
        f(&mut *self.strategy, &mut gate)
    }

    /// A cached block of `rounded` bytes safe for `stream` (`key`), if the strategy has one.
    pub fn take_cached(&mut self, rounded: usize, key: StreamKey, stream: StreamHandle) -> Option<Block> {
        self.with_gate(key, stream, |s, gate| s.take(rounded, key, gate))
    }

    /// Enqueue a fence on the legacy stream (`Pool::fence_legacy_now`); where none can be
    /// recorded, wait for the legacy stream instead (`device_wait`: whether that wait may
    /// wait for the whole device). False when neither worked.
    pub fn fence_legacy(&mut self, device_wait: bool) -> bool {
        // Mark the legacy stream as freed-on so the fence records, then record it.
        let _ = self.streams.on_free(&mut *self.upstream, StreamKey::LEGACY, crate::stream::STREAM_LEGACY, &[]);
        if self.streams.fence_legacy(&mut *self.upstream).is_ok() {
            return true;
        }
        // Without a fence the blocks cannot be proven safe: wait for the legacy stream
        // instead (a record and a wait on it).
        self.streams.synchronize(&mut *self.upstream, StreamKey::LEGACY, device_wait).is_ok()
    }

    /// Whether the unfenced frees reached their batch bound (`UNFENCED_MAX_BLOCKS` /
    /// `UNFENCED_MAX_BYTES`) and must be fenced now.
    #[inline]
    pub fn unfenced_full(&self) -> bool {
        self.unfenced.len() >= UNFENCED_MAX_BLOCKS || self.unfenced_bytes >= UNFENCED_MAX_BYTES
    }

    /// Hold a stream-less free until the next legacy-stream fence.
    #[inline]
    pub fn push_unfenced(&mut self, block: Block) {
        self.unfenced_bytes += block.size;
        self.unfenced.push(block);
    }

    /// Take every unfenced free (a fence was just recorded).
    pub fn take_unfenced(&mut self) -> Vec<Block> {
        self.unfenced_bytes = 0;
        std::mem::take(&mut self.unfenced)
    }

    /// Whether `ptr` is the start of a block freed into the core and not handed out again
    /// (cached, deferred or unfenced).
    pub fn holds_freed(&self, ptr: usize) -> bool {
        self.strategy.is_free_block(ptr) || self.pending.iter().any(|p| p.block.addr == ptr) || self.unfenced.iter().any(|b| b.addr == ptr)
    }

    /// The live block `ptr` points inside of (not at its start), if any.
    pub fn live_around(&self, ptr: usize) -> Option<&Block> {
        self.live.values().map(|l| &l.block).find(|b| b.addr < ptr && ptr < b.end())
    }

    /// Bytes cached in the strategy and backed by memory (its decommitted pages left out).
    #[inline]
    pub fn cached_committed(&self) -> usize {
        self.strategy.cached_bytes().saturating_sub(self.holes.bytes())
    }
}

/// What the core is: its device, its shard, what runs and what it says about it.
impl Core {
    #[inline]
    pub fn device(&self) -> i32 {
        self.device
    }

    #[inline]
    pub fn shard(&self) -> u16 {
        self.shard
    }

    /// Why the configured strategy is not the one running, if it is not.
    pub fn notice(&self) -> Option<&str> {
        self.notice.as_deref()
    }

    /// Enter `[base, base + len)` in the address index as this pool's memory.
    #[inline]
    pub fn index_range(&self, base: usize, len: usize) {
        crate::owners::add(base, len, self.device, self.shard);
    }

    /// Take the range at `base` out of the address index (before it goes back: once
    /// released, the address may be another device's).
    #[inline]
    pub fn unindex_range(&self, base: usize) {
        crate::owners::remove(base, self.device, self.shard);
    }
}

/// The upstream and the strategy. The upstream is the driver of this device's memory: the
/// pool's layers ask it directly for what concerns no book of the core (exports, imports,
/// captures, pauses, reports).
impl Core {
    #[inline]
    pub fn upstream(&self) -> &dyn Upstream {
        &*self.upstream
    }

    #[inline]
    pub fn upstream_mut(&mut self) -> &mut dyn Upstream {
        &mut *self.upstream
    }

    #[inline]
    pub fn strategy(&self) -> &dyn Strategy {
        &*self.strategy
    }

    #[inline]
    pub fn strategy_mut(&mut self) -> &mut dyn Strategy {
        &mut *self.strategy
    }

    /// The arena, where the strategy is the arena.
    #[inline]
    pub fn arena(&self) -> Option<&ArenaStrategy> {
        match &self.strategy {
            PoolStrategy::Arena(a) => Some(a),
            PoolStrategy::Segments(_) => None,
        }
    }

    #[inline]
    pub fn arena_mut(&mut self) -> Option<&mut ArenaStrategy> {
        match &mut self.strategy {
            PoolStrategy::Arena(a) => Some(a),
            PoolStrategy::Segments(_) => None,
        }
    }

    /// `PoolOptions::arena_lend`: whether the arena lends granules across its ranges.
    #[inline]
    pub fn arena_lend(&self) -> bool {
        self.arena_lend
    }

    /// Bytes of arena granules unmapped but not released (`book_arena_leak`).
    #[inline]
    pub fn arena_leaked(&self) -> usize {
        self.arena_leaked
    }

    /// Book `bytes` of granules the driver unmapped and would not release.
    pub fn book_arena_leak(&mut self, bytes: usize) {
        self.arena_leaked += bytes;
    }

    /// Run `f` on the arena with the reuse gate of a request on `stream` (`key`), as
    /// `with_gate` does for any strategy. None where the strategy is not the arena.
    pub fn with_arena_gate<R>(&mut self, key: StreamKey, stream: StreamHandle, f: impl FnOnce(&mut ArenaStrategy, &mut dyn FnMut(StreamKey, usize, usize) -> bool) -> R) -> Option<R> {
        let PoolStrategy::Arena(a) = &mut self.strategy else { return None };
        let mut gate = self.streams.reuse_gate(&mut *self.upstream, key, stream);
        Some(f(a, &mut gate))
    }
}
