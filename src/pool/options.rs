//! How to build a pool (`PoolOptions`): the strategy, the limit, the stream and
//! thread-cache settings, the shard and its shared budget, and the test switches
//! (`crate::registry` fills them in from the configuration).

use super::budget::Budget;
use crate::config::{LimitSpec, PoolKind};
use crate::trace::Tracer;

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
    /// `GPUPOOL_EVENT_BATCH`: user-stream frees per event record (`crate::stream`).
    pub event_batch: usize,
    /// `GPUPOOL_EVENT_BATCH_BYTES`: bytes a user stream may leave unrecorded.
    pub event_batch_bytes: usize,
    /// `GPUPOOL_ARENA_LEND` (default on): the arena's ranges grow into each other's free
    /// granules (`Pool::map_window`).
    pub arena_lend: bool,
    /// `GPUPOOL_ARENA_CHUNK`: the largest physical allocation the arena maps for a long
    /// growth (`strategy/arena/chunks.rs`); a granule or less: granule by granule.
    pub arena_chunk: usize,
    /// `GPUPOOL_ARENA_CHUNK_FROM`: the shortest growth the arena maps as chunks.
    pub arena_chunk_from: usize,
    /// `GPUPOOL_ARENA_PIECE_ENDS`: new stitches may end in pieces of granules partly in use.
    pub arena_piece_ends: bool,
    /// The arena's granule, each allocation it maps (0: the device's granularity): a tag's
    /// pool maps larger ones (Note [A tag's granule], `crate::registry`).
    pub arena_granule: usize,
    /// Private pools (CUDA graphs, `MemPool`s) map virtual memory from the arena's
    /// upstream, which a pause releases with the rest (a tag's pool, Note [Graph pools
    /// under a tag]); otherwise they are `cuMemAlloc` segments.
    pub private_pools_mapped: bool,
    /// The device's budget, shared by its shards (`crate::registry`); `None`: this pool's own.
    pub budget: Option<std::sync::Arc<Budget>>,
    /// Which shard of its device this pool is (0 for a device that is not sharded): the
    /// address index (`crate::owners`) names it, so a free finds its pool.
    pub shard: u16,
}

impl PoolOptions {
    /// Whether a pool built with these options for `device` attaches thread caches: where
    /// they ask for them and nothing needs every operation to reach the pool (debug records,
    /// a trace, `none`), never in the unsafe test mode (whose point is a pool that reuses at
    /// once, the way the cache never does), and never for a caller's upstream (no device).
    pub(super) fn wants_thread_caches(&self, device: i32) -> bool {
        self.thread_cache
            && self.debug == 0
            && self.tracer.is_none()
            && self.kind != PoolKind::None
            && !self.unsafe_ignore_streams
            && device >= 0
    }
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            // The library's default, as `Config::default` has it.
            kind: PoolKind::Arena,
            limit: None,
            check_invariants: false,
            unsafe_ignore_streams: false,
            debug: 0,
            tracer: None,
            decay_window: crate::decay::DEFAULT_WINDOW,
            arena_va: None,
            thread_cache: true,
            event_batch: crate::stream::EVENT_BATCH,
            event_batch_bytes: crate::stream::EVENT_BATCH_BYTES,
            arena_lend: true,
            arena_chunk: crate::strategy::arena::CHUNK_MAX,
            arena_chunk_from: crate::strategy::arena::CHUNK_FROM,
            arena_piece_ends: false,
            arena_granule: 0,
            private_pools_mapped: false,
            budget: None,
            shard: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_pool_and_the_configuration_have_one_default_strategy() {
        assert_eq!(super::PoolOptions::default().kind, crate::config::Config::default().pool);
    }
}
