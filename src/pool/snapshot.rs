//! The pool's memory as PyTorch's memory snapshot describes it (`torch.cuda.memory._snapshot()`):
//! segments, each cut into blocks that are allocated, waiting to be freed, or free. Rendered
//! as JSON here; `gpupool.snapshot.snapshot()` turns it into PyTorch's dictionary so its memory
//! visualizer and `torch.cuda._memory_viz` read memory from any framework, CuPy and C included.
//!
//! Segments are the upstream allocations for the segment strategies; for the arena, which
//! has none, each run of contiguous mapped blocks is one (expandable) segment.

use super::core::Core;
use super::graph_pools::PrivatePools;
use crate::block::Block;
use crate::thread_cache::state::AttachedCaches;
use std::fmt::Write;

#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    Allocated,
    /// Freed by its user, not yet reusable (a deferred or unfenced free, a thread cache's).
    PendingFree,
    Free,
}

impl State {
    fn name(self) -> &'static str {
        match self {
            State::Allocated => "active_allocated",
            State::PendingFree => "active_pending_free",
            State::Free => "inactive",
        }
    }
}

struct Piece {
    block: Block,
    requested: usize,
    state: State,
    /// The private pool holding it, if any (PyTorch's `segment_pool_id`).
    pool: (u64, u64),
}

/// The `segments` array's items of a pool's snapshot, comma-separated, from its layers: the
/// core's live, pending and free blocks, the private pools', and the blocks thread caches
/// keep (freed by their users, so pending): `{"address":A,"total_size":N,"stream":S,
/// "pool_id":[a,b],"is_expandable":false,"blocks":[{"address":A,"size":N,
/// "requested_size":R,"state":"active_allocated"},...]}`.
pub(super) fn segments(core: &Core, caches: &AttachedCaches, graphs: &PrivatePools) -> String {
    let kept = caches.kept();
    let mut pieces: Vec<Piece> = Vec::new();
    for l in core.live_blocks() {
        let state = if kept.contains(&l.block.addr) { State::PendingFree } else { State::Allocated };
        pieces.push(Piece { block: l.block, requested: l.requested, state, pool: l.private.unwrap_or((0, 0)) });
    }
    let pending = core.deferred_blocks().copied().chain(core.unfenced_blocks().copied());
    for b in pending.chain(graphs.pending_blocks()) {
        pieces.push(Piece { block: b, requested: b.size, state: State::PendingFree, pool: (0, 0) });
    }
    for b in core.strategy().free_blocks() {
        pieces.push(Piece { block: b, requested: b.size, state: State::Free, pool: (0, 0) });
    }
    for (id, b) in graphs.free_blocks_by_pool() {
        pieces.push(Piece { block: b, requested: b.size, state: State::Free, pool: id });
    }
    pieces.sort_unstable_by_key(|p| p.block.addr);
    let arena = core.is_arena();
    // Group into segments: by upstream allocation, or (arena) by contiguity.
    let mut segments: Vec<Vec<Piece>> = Vec::new();
    for p in pieces {
        let joins = segments.last().and_then(|s| s.last()).is_some_and(|last| {
            if arena {
                last.block.end() == p.block.addr
            } else {
                last.block.segment == p.block.segment
            }
        });
        if joins {
            segments.last_mut().expect("checked").push(p);
        } else {
            segments.push(vec![p]);
        }
    }
    let mut out = String::new();
    for (i, seg) in segments.iter().enumerate() {
        let first = &seg[0];
        let total: usize = seg.iter().map(|p| p.block.size).sum();
        let _ = write!(
            out,
            "{}{{\"address\":{},\"total_size\":{},\"stream\":{},\"pool_id\":[{},{}],\"is_expandable\":{},\"blocks\":[",
            if i > 0 { "," } else { "" },
            first.block.addr,
            total,
            first.block.stream.0,
            first.pool.0,
            first.pool.1,
            arena
        );
        for (j, p) in seg.iter().enumerate() {
            let _ = write!(
                out,
                "{}{{\"address\":{},\"size\":{},\"requested_size\":{},\"state\":\"{}\"}}",
                if j > 0 { "," } else { "" },
                p.block.addr,
                p.block.size,
                p.requested,
                p.state.name()
            );
        }
        out.push_str("]}");
    }
    out
}
