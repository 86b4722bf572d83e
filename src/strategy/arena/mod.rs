//! `arena`: a pool that does not fragment, built on the virtual memory management API.
//!
//! Each device reserves large address ranges up front (`space.rs`): one for small requests
//! (<= 512 KiB, so their long-lived crumbs never pin the granules large tensors need), one
//! for the rest, and one for stitches. Physical memory is mapped into them granule by
//! granule (2 MiB on current GPUs) only where blocks need it; a long growth of the large
//! range is mapped as a few chunks of many granules (`chunks.rs`), which are then stitched,
//! released and exported whole.
//!
//! - Blocks are carved best fit from mapped free memory at 512 B and coalesce with free
//!   neighbours anywhere in their range. Freed memory stays mapped: reuse makes no driver
//!   call.
//! - A request that no free block serves gets, in this order: a window of free memory and
//!   address space that needs no new memory (`plan.rs`); a cached stitch whose granules
//!   are all free again (`stitch.rs`, no driver call); a new stitch of scattered free
//!   granules mapped side by side (one alias per allocation: a granule or a whole chunk,
//!   once), which may begin and end in free ends of granules partly in use where piece
//!   ends are on; and only when the free granules do not suffice, new memory mapped under
//!   a window.
//! - Memory goes back only under pressure (limit, OOM, reclaim, decay), as whole free
//!   granules, in bulk; stitches over them are dropped first.
//!
//! The strategy plans and keeps the books; the pool (`pool/grow.rs`, `pool/release.rs`,
//! `pool/arena/export.rs`) makes the driver calls, so all of this is testable without a GPU.

mod carve;
mod chunks;
pub use chunks::{CHUNK_FROM, CHUNK_MAX};
mod export;
mod grow;
mod loans;
mod release;
pub mod plan;
pub mod space;
pub mod stitch;

use super::{ReleaseOrder, Strategy};
use crate::block::{round_up, Block, Segment};
use crate::upstream::stream_id::StreamKey;
use space::{FreeRun, Space, ROUND};
use export::Exports;
use stitch::Stitches;

/// Requests up to this size live in the small space: a quarter of a 2 MiB granule. Why not
/// PyTorch's 1 MiB: blocks above a quarter granule and up to half are no crumbs (a
/// server's KV caches at a few hundred tokens), and in the small range they share granules
/// with the crumbs, which pin the granules they leave as they grow; in the large range
/// they pack beside the larger caches they grow into (`tests/replay.rs`, the serving loop).
pub const SMALL_LIMIT: usize = 512 << 10;
const SMALL: usize = 0;
const LARGE: usize = 1;

/// What the arena has done, for the reports.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct ArenaCounters {
    /// Granules of new memory mapped, and granules released.
    pub granules_mapped: u64,
    pub granules_unmapped: u64,
    /// Stitches made (each maps its granules once more), handed out again from the cache
    /// (no driver call), and dropped (evicted, or their memory released).
    pub stitches_made: u64,
    pub stitch_reuses: u64,
    pub stitches_dropped: u64,
    pub granules_aliased: u64,
    /// Pieces of granules partly in use that new stitches began or ended in (`plan::piece_ends`).
    pub stitch_pieces: u64,
    /// Granules of one range that show a free granule of the other instead of new memory
    /// (`lend`, both directions), and loans ended (`end_loan`).
    pub granules_lent: u64,
    pub loans_ended: u64,
}

/// What a growth allows `plan` at its current step: the pool's escalation relaxes them one
/// by one where the plan found nothing or its driver calls were refused
/// (`pool/grow.rs`, `ArenaGrowth`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PlanRules {
    /// A full stitch cache may evict a stitch. False once an eviction failed in this growth
    /// (its stream's work could not be waited for): the same stitch would be chosen forever.
    pub may_evict: bool,
    /// Requests of at most `CONTENDED_STITCH_FROM` granules may be stitched anew. Off while
    /// the device's shards contend for the driver (`pool/contention.rs`); cached stitches
    /// are reused either way.
    pub small_stitches: bool,
    /// Piece ends may be tried while the stitch cache is full: off at the start of each
    /// growth, on once the window taken instead was refused.
    pub pieces_when_full: bool,
}

impl Default for PlanRules {
    fn default() -> PlanRules {
        PlanRules { may_evict: true, small_stitches: true, pieces_when_full: false }
    }
}

/// How `plan` serves a request that no free block serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Growth {
    /// Map new memory under `window.targets` (none: no driver call), then carve the window.
    Window { space: usize, window: plan::Window },
    /// Hand out `granules` granules of cached stitch `id` from its granule `first` on,
    /// whose homes are all free.
    Reuse { id: u32, first: usize, granules: usize },
    /// Map new memory under the unmapped granules `fresh` of the large space, then alias
    /// `homes` (free granules, `fresh` among them; chunks whole) side by side at `base` as
    /// a new stitch, and hand out its first `take` granules.
    /// `head` bytes (0: none) of the first home and, where `tail`, the start of the last are
    /// pieces of granules partly in use (`plan::piece_ends`): the block takes only those parts.
    Stitch { base: usize, homes: Vec<usize>, fresh: Vec<usize>, take: usize, head: usize, tail: bool },
    /// A stitch would serve, but the stitch cache is full: evict `id` and plan again.
    Evict { id: u32 },
}

pub struct ArenaStrategy {
    spaces: [Space; 2],
    stitches: Stitches,
    granule: usize,
    /// Granules of one range that show the memory of a granule of the other (`lend`):
    /// address -> the other range's node booked as allocated for it.
    loans: std::collections::BTreeMap<usize, space::Slot>,
    /// How many of `loans` are in the small range (their homes in the large one).
    small_loans: usize,
    /// Granules where an alias the driver would not remove stays mapped (a loan whose access
    /// grant failed, and whose undo failed too): booked as allocated, so nothing is placed
    /// there, until the pool removes the alias (`stuck`, `unstick`). They hold no memory of
    /// their own; the home they show is booked as allocated in its range too (as a loan's
    /// is), so it is neither handed out nor given back while the alias holds its memory.
    stuck: std::collections::BTreeMap<usize, loans::Stuck>,
    /// Exported blocks' guards (`export.rs`).
    exports: Exports,
    /// Allocations of several granules in the large range (`chunks.rs`).
    chunks: chunks::Chunks,
    /// What the last granules of the stitched blocks in use hold past their bytes.
    stitch_tail_bytes: usize,
    /// Whether new stitches may begin and end in pieces of granules partly in use
    /// (`plan::piece_ends`; `GPUPOOL_ARENA_PIECE_ENDS`).
    piece_ends: bool,
    pub counters: ArenaCounters,
}

/// While the device's shards contend for the driver, only requests of more than this many
/// granules are stitched anew; the others get a window (new memory, or the other range's
/// lent granules), which is needed only until there is enough, where their stitches would
/// go on costing serialised driver calls. Larger requests keep stitching, where new memory
/// would cost the most.
pub const CONTENDED_STITCH_FROM: usize = 4;

impl ArenaStrategy {
    /// Whether new stitches may end in pieces of granules partly in use (`plan::piece_ends`).
    pub fn set_piece_ends(&mut self, on: bool) {
        self.piece_ends = on;
    }

    /// Whether piece ends are on (`set_piece_ends`).
    pub fn piece_ends(&self) -> bool {
        self.piece_ends
    }

    /// Over the reserved ranges `small`, `large` and `stitch` (`(base, len)`, granule aligned).
    pub fn new(small: (usize, usize), large: (usize, usize), stitch: (usize, usize), granule: usize) -> ArenaStrategy {
        ArenaStrategy {
            spaces: [Space::new(small.0, small.1, granule), Space::new(large.0, large.1, granule)],
            stitches: Stitches::new(stitch.0, stitch.1),
            stitch_tail_bytes: 0,
            piece_ends: false,
            granule,
            loans: Default::default(),
            small_loans: 0,
            stuck: Default::default(),
            exports: Exports::default(),
            chunks: chunks::Chunks::new(granule),
            counters: ArenaCounters::default(),
        }
    }

    pub fn granule(&self) -> usize {
        self.granule
    }

    /// The largest block the arena could ever hand out: one that fills the large range or
    /// the stitch range.
    pub fn largest_possible_block(&self) -> usize {
        self.spaces[LARGE].len.max(self.stitches.len)
    }

    /// The reserved ranges `(base, len)`: small, large, stitch.
    pub fn reservations(&self) -> [(usize, usize); 3] {
        [
            (self.spaces[0].base, self.spaces[0].len),
            (self.spaces[1].base, self.spaces[1].len),
            (self.stitches.base, self.stitches.len),
        ]
    }

    fn class(rounded: usize) -> usize {
        if rounded <= SMALL_LIMIT {
            SMALL
        } else {
            LARGE
        }
    }

    /// 0 for the small range, 1 for the large one (the stitch range counts as large).
    pub fn space_of_addr(&self, addr: usize) -> usize {
        self.space_of(addr)
    }

    fn space_of(&self, addr: usize) -> usize {
        if self.spaces[SMALL].contains(addr) {
            SMALL
        } else {
            LARGE
        }
    }

    /// New memory now backs `[addr, addr + len)`.
    pub fn mapped(&mut self, addr: usize, len: usize, stream: StreamKey) {
        let si = self.space_of(addr);
        self.spaces[si].mark_mapped(addr, len, stream);
        self.counters.granules_mapped += (len / self.granule) as u64;
    }

    /// The memory of `[addr, addr + len)` (a whole free allocation, no stitch over it) went back.
    pub fn unmapped(&mut self, addr: usize, len: usize) {
        self.chunks.remove(addr);
        let si = self.space_of(addr);
        self.spaces[si].mark_unmapped(addr, len);
        self.counters.granules_unmapped += (len / self.granule) as u64;
    }

    /// Bytes mapped by the books (used + free; stitches and loans add no memory).
    pub fn mapped_bytes(&self) -> usize {
        self.spaces.iter().map(|s| s.mapped_bytes()).sum::<usize>() - (self.loans.len() + self.stuck.len()) * self.granule
    }

    /// (mapped, free) bytes of the small and of the large range: where the mapped memory
    /// that serves nothing lies.
    pub fn space_usage(&self) -> [(usize, usize); 2] {
        // A lent granule's memory counts where it is shown, not where its home is booked.
        let free = |s: &Space| s.free_blocks().iter().map(|b| b.size).sum();
        let g = self.granule;
        let (small_lent, large_lent) = (self.small_loans * g, (self.loans.len() - self.small_loans) * g);
        [
            (self.spaces[SMALL].mapped_bytes() - large_lent, free(&self.spaces[SMALL])),
            (self.spaces[LARGE].mapped_bytes() - small_lent, free(&self.spaces[LARGE])),
        ]
    }

    pub fn reserved_address_space(&self) -> usize {
        self.spaces.iter().map(|s| s.len).sum::<usize>() + self.stitches.len
    }

    pub fn stitch_count(&self) -> usize {
        self.stitches.count()
    }
}

impl Strategy for ArenaStrategy {
    fn name(&self) -> &'static str {
        "arena"
    }

    fn round(&self, size: usize) -> Option<usize> {
        round_up(size, ROUND).filter(|&s| s <= isize::MAX as usize)
    }

    /// The arena grows through `plan`, never by segments.
    fn segment_size(&self, _rounded: usize) -> Option<usize> {
        None
    }

    fn take(&mut self, rounded: usize, stream: StreamKey, reusable: &mut dyn FnMut(StreamKey, usize, usize) -> bool) -> Option<Block> {
        self.spaces[Self::class(rounded)].take(rounded, stream, reusable)
    }

    fn add_segment(&mut self, seg: Segment, _rounded: usize) -> Block {
        // `segment_size` is None, so the pool never gets here; say so loudly if it does.
        panic!("arena: add_segment({seg:?}) called; the arena grows through plan()")
    }

    fn home_ranges(&self, block: &Block, out: &mut Vec<(usize, usize)>) {
        if self.stitches.contains(block.addr) {
            // Its memory goes back as the home granules' nodes it borrowed (`put`).
            for &slot in &self.stitches.get(block.handle).borrowed {
                let n = self.spaces[LARGE].node(slot);
                out.push((n.addr, n.size));
            }
        } else {
            out.push((block.addr, block.size));
        }
    }

    fn put(&mut self, block: Block) -> Option<Segment> {
        if !self.exports.is_empty() {
            self.unguard(block.addr);
        }
        if self.stitches.contains(block.addr) {
            // The stitch stays mapped and cached; its home granules are free again.
            let st = self.stitches.get_mut(block.handle);
            self.stitch_tail_bytes -= st.tail_in_use;
            st.in_use = false;
            st.last_stream = Some(block.stream);
            for slot in std::mem::take(&mut st.borrowed) {
                let n = *self.spaces[LARGE].node(slot);
                let home = Block { addr: n.addr, size: n.size, segment: self.spaces[LARGE].base, stream: block.stream, handle: slot };
                self.spaces[LARGE].put(home);
            }
            self.stitches.touch(block.handle);
            return None;
        }
        let si = self.space_of(block.addr);
        self.spaces[si].put(block);
        None
    }

    fn drain_free_segments(&mut self, _want: Option<usize>, _order: ReleaseOrder, _releasable: &mut dyn FnMut(StreamKey) -> bool) -> Vec<Segment> {
        Vec::new() // no segments: the pool releases granules (`releasable`)
    }

    fn cached_bytes(&self) -> usize {
        // A quarantined alias's home is held for nothing, as cached memory is.
        self.spaces.iter().map(|s| s.free_bytes).sum::<usize>() + self.exports.guard_bytes + self.stuck.len() * self.granule + self.stitch_tail_bytes
    }

    fn held_beyond_blocks(&self) -> usize {
        self.stitch_tail_bytes
    }

    fn free_block_count(&self) -> usize {
        self.spaces.iter().map(|s| s.free_count()).sum()
    }

    /// Stitch blocks are not split: the pool reports their whole length.
    fn largest_free_block(&self) -> usize {
        self.spaces.iter().map(|s| s.largest_free()).max().unwrap_or(0)
    }

    fn free_blocks(&self) -> Vec<Block> {
        self.spaces.iter().flat_map(|s| s.free_blocks()).collect()
    }

    fn is_free_block(&self, addr: usize) -> bool {
        self.spaces.iter().any(|s| s.contains(addr) && s.is_free_block(addr))
    }

    fn check_invariants(&self) -> Result<(), String> {
        for s in &self.spaces {
            s.check_invariants()?;
        }
        self.stitches.check_invariants()?;
        self.chunks.check(|a| self.spaces[LARGE].is_mapped(a))?;
        let g = self.granule;
        let large = &self.spaces[LARGE];
        for (&at, &slot) in &self.loans {
            let si = self.space_of(at);
            let n = self.spaces[1 - si].node(slot);
            if !self.spaces[si].is_mapped(at) || n.state != space::State::Allocated || n.size != g || n.addr % g != 0 {
                return Err(format!("loan at {at:#x}: granule mapped {}, home {:?}", self.spaces[si].is_mapped(at), n));
            }
        }
        for (&at, st) in &self.stuck {
            let si = self.space_of(at);
            let (n, home) = (self.spaces[si].node(st.slot), self.spaces[1 - si].node(st.home));
            if n.state != space::State::Allocated || n.addr != at || home.state != space::State::Allocated || home.size != g || home.addr % g != 0 {
                return Err(format!("quarantined alias at {at:#x}: {n:?}, home {home:?}"));
            }
        }
        if self.loans.keys().filter(|&&a| self.space_of(a) == SMALL).count() != self.small_loans {
            return Err("arena: small-range loan count is off".into());
        }
        let tails: usize = self.stitches.iter().filter(|(_, s)| s.in_use).map(|(_, s)| s.tail_in_use).sum();
        if tails != self.stitch_tail_bytes {
            return Err(format!("arena: stitch tails {} bytes, booked {}", tails, self.stitch_tail_bytes));
        }
        for (id, st) in self.stitches.iter() {
            if st.len != st.homes.len() * g {
                return Err(format!("stitch {id}: {} bytes for {} granules", st.len, st.homes.len()));
            }
            // Handed out: its homes are exactly its borrowed nodes; else its homes are mapped.
            let covered: usize = st.borrowed.iter().map(|&b| large.node(b).size).sum();
            // Whole granules booked whole, the rest of the last counted apart; a pieced one
            // books exactly its bytes but where its last granule is whole.
            let booked = if st.pieced { st.bytes_in_use + st.tail_in_use } else { st.granules_in_use * g };
            if st.in_use && (covered != booked || st.first_in_use + st.granules_in_use > st.homes.len()) {
                return Err(format!("stitch {id}: borrowed nodes cover {covered} of {booked} bytes"));
            }
            if st.in_use && (st.bytes_in_use > st.granules_in_use * g || st.tail_in_use >= g) {
                return Err(format!("stitch {id}: a block of {} bytes over {} granules", st.bytes_in_use, st.granules_in_use));
            }
            if st.homes.iter().any(|&h| !large.is_mapped(h)) {
                return Err(format!("stitch {id}: a home granule is not mapped"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
