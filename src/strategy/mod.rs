//! Caching policies. A strategy owns the bookkeeping of cached (free) memory and decides
//! which block serves a request; the pool (`crate::pool`) owns everything else: the lock, the
//! live-pointer map, limits, stats, streams and the upstream.
//!
//! Adding a strategy is one file here plus one arm in `build`.

pub mod arena;
pub mod binned;
pub mod bins;
pub mod none;
pub mod slab;
pub mod split;

use crate::block::{Block, Segment};
use crate::config::PoolKind;
use crate::upstream::stream_id::StreamKey;

/// Which cached segments go back first.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ReleaseOrder {
    /// Out of memory, limits: the fewest upstream calls for the bytes wanted.
    LargestFirst,
    /// Decay: the segments idle longest, least likely to be wanted again soon.
    OldestFirst,
}

/// The contract between the pool and a caching policy.
///
/// - Blocks passed to `put` are exactly blocks this strategy handed out (`take` or
///   `add_segment`); the pool validates pointers before calling it.
/// - `take` may hand a block last used on another stream only if `reusable(that_stream,
///   addr, len)` returned true for free memory covering it (the pool made it safe, e.g.
///   with `cuStreamWaitEvent`, or refused: that memory's free is not covered by an event
///   yet). `addr`/`len` name memory as `home_ranges` does.
/// - Segments returned by `put` or `drain_free_segments` are no longer referenced by the
///   strategy; the pool gives them back to the upstream.
/// - Strategies never call the upstream, never wait for the device and share no state
///   with other pools or processes (a block's exports are the pool's, `share::exports`).
pub trait Strategy: Send {
    fn name(&self) -> &'static str;

    /// The size actually handed out for a request of `size` bytes (> 0); `None` when the
    /// request cannot be represented (overflow): the pool reports out of memory.
    fn round(&self, size: usize) -> Option<usize>;

    /// How much to ask the upstream for when no cached block serves `rounded` bytes.
    fn segment_size(&self, rounded: usize) -> Option<usize>;

    /// A cached block of at least `rounded` bytes for `stream`, or `None`.
    fn take(&mut self, rounded: usize, stream: StreamKey, reusable: &mut dyn FnMut(StreamKey, usize, usize) -> bool) -> Option<Block>;

    /// Adopt a fresh upstream segment and carve from it a block of `rounded` bytes.
    fn add_segment(&mut self, seg: Segment, rounded: usize) -> Block;

    /// The memory of `block`, as `reusable` will name it once the block is put back: the
    /// block itself, except where a strategy hands out one memory under two addresses
    /// (the arena's stitches: their home granules).
    fn home_ranges(&self, block: &Block, out: &mut Vec<(usize, usize)>) {
        out.push((block.addr, block.size));
    }

    /// Take back a block freed on `block.stream`. Returns a segment to release right away
    /// (strategies that do not cache).
    fn put(&mut self, block: Block) -> Option<Segment>;

    /// Move deferred frees into the searchable structures (coalescing them). Returns
    /// whether anything moved, i.e. whether a retry of `take` may now succeed.
    fn flush_deferred(&mut self) -> bool {
        false
    }

    /// Remove wholly free segments in `order` until at least `want` bytes are gathered
    /// (`None`: all of them). Strategies without a clock use largest first. A segment with
    /// a free block from a stream `releasable` refuses stays where it is, untouched (the
    /// pool cannot prove that stream's work on it done now).
    fn drain_free_segments(&mut self, want: Option<usize>, order: ReleaseOrder, releasable: &mut dyn FnMut(StreamKey) -> bool) -> Vec<Segment>;

    /// Every free block (deferred frees flushed first), in the order their pages should be
    /// decommitted: longest idle first where the strategy knows, since memory freed moments
    /// ago is the likeliest to be wanted again at once.
    fn decommit_candidates(&mut self) -> Vec<Block> {
        self.flush_deferred();
        self.free_blocks()
    }

    /// Bytes held free (cached).
    fn cached_bytes(&self) -> usize;

    /// The part of `cached_bytes` that live blocks hold beyond their size, which no release
    /// can give back while they live (the arena: the rest of a stitched block's last granule).
    fn held_beyond_blocks(&self) -> usize {
        0
    }
    fn free_block_count(&self) -> usize;
    fn largest_free_block(&self) -> usize;
    /// Every free block (reports, tests, invariant scans).
    fn free_blocks(&self) -> Vec<Block>;
    /// Size of the upstream allocation starting at `base`, when the strategy splits segments
    /// (strategies whose blocks are whole segments return `None`).
    fn segment_len(&self, _base: usize) -> Option<usize> {
        None
    }
    /// Whether `addr` is the start of a block this strategy holds as free (double-free detection).
    fn is_free_block(&self, addr: usize) -> bool;
    /// Full consistency scan of the internal structures.
    fn check_invariants(&self) -> Result<(), String>;
}

/// Build the strategy for a configured kind. The arena needs address space reserved from
/// the upstream first: `Pool::new` builds it (and asks here for its fallback, `split`).
pub fn build(kind: PoolKind) -> Box<dyn Strategy> {
    match kind {
        PoolKind::Split | PoolKind::Arena => Box::new(split::SplitStrategy::new()),
        PoolKind::Binned => Box::new(binned::BinnedStrategy::new()),
        PoolKind::None => Box::new(none::NoneStrategy::new()),
    }
}
