//! `arena`: a pool that does not fragment, built on the virtual memory management API.
//!
//! Each device reserves two large address ranges up front (`space.rs`): one for small
//! requests (<= 1 MiB, so their long-lived crumbs never pin the granules large tensors
//! need) and one for the rest. Physical memory is mapped into them granule by granule
//! (2 MiB on current GPUs) only where blocks need it.
//!
//! - Blocks are carved best fit from mapped free memory at 512 B and coalesce with free
//!   neighbours anywhere in the range. Freed memory stays mapped: reuse makes no driver call.
//! - A request that no mapped free block serves gets a window of address space (`plan.rs`)
//!   whose unmapped granules are backed by free granules moved from elsewhere (their
//!   physical memory is mapped at the window and unmapped where it was), and only the rest
//!   by new memory. The pool (`pool/arena.rs`) makes those driver calls; this strategy only
//!   plans and keeps the books, so it stays testable without a GPU.
//! - Memory goes back only under pressure (limit, OOM, reclaim, decay), as whole free
//!   granules, in bulk.
//!
//! Cost: a step that allocates a size never seen at that place before pays a few driver
//! calls per granule once; afterwards the window is mapped free memory like any other.

pub mod plan;
pub mod space;

use super::{ReleaseOrder, Strategy};
use crate::block::{round_up, Block, Segment};
use crate::stream::StreamKey;
use space::{Space, ROUND};

/// Requests up to this size live in the small space.
pub const SMALL_LIMIT: usize = 1 << 20;
const SMALL: usize = 0;
const LARGE: usize = 1;

/// What the arena has done, for the reports.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct ArenaCounters {
    /// Growths that moved free granules into place instead of mapping new memory.
    pub stitches: u64,
    pub granules_moved: u64,
    /// Granules of new memory mapped, and granules released.
    pub granules_mapped: u64,
    pub granules_unmapped: u64,
}

/// A growth chosen by `plan`: map `window.targets` (moving `donors` there first), then
/// `carve`.
#[derive(Clone, Debug)]
pub struct Growth {
    pub space: usize,
    pub window: plan::Window,
    pub donors: Vec<plan::Donor>,
}

pub struct ArenaStrategy {
    spaces: [Space; 2],
    granule: usize,
    pub counters: ArenaCounters,
}

impl ArenaStrategy {
    /// Over the reserved ranges `small = (base, len)` and `large`, granule aligned.
    pub fn new(small: (usize, usize), large: (usize, usize), granule: usize) -> ArenaStrategy {
        ArenaStrategy {
            spaces: [Space::new(small.0, small.1, granule), Space::new(large.0, large.1, granule)],
            granule,
            counters: ArenaCounters::default(),
        }
    }

    pub fn granule(&self) -> usize {
        self.granule
    }

    /// The reserved ranges `(base, len)`, small then large.
    pub fn reservations(&self) -> [(usize, usize); 2] {
        [(self.spaces[0].base, self.spaces[0].len), (self.spaces[1].base, self.spaces[1].len)]
    }

    fn class(rounded: usize) -> usize {
        if rounded <= SMALL_LIMIT {
            SMALL
        } else {
            LARGE
        }
    }

    fn space_of(&self, addr: usize) -> usize {
        if self.spaces[SMALL].contains(addr) {
            SMALL
        } else {
            LARGE
        }
    }

    /// Where `rounded` bytes for `stream` should go when no mapped free block serves them:
    /// the cheapest window whose other streams' free memory `reusable` allows, and the free
    /// granules to move there. `None`: no address space left that could hold it.
    pub fn plan(&self, rounded: usize, stream: StreamKey, reusable: &mut dyn FnMut(StreamKey) -> bool) -> Option<Growth> {
        let si = Self::class(rounded);
        let window = plan::windows(&self.spaces[si], rounded, stream)
            .into_iter()
            .find(|w| w.foreign.iter().all(|&s| reusable(s)))?;
        let refs = [&self.spaces[0], &self.spaces[1]];
        let donors = plan::donors(&refs, window.targets.len(), si, window.start, window.start + window.len);
        Some(Growth { space: si, window, donors })
    }

    /// The granule at `from` (a donor) now backs `to` in `growth`'s window.
    pub fn moved(&mut self, from_space: usize, from: usize, to_space: usize, to: usize, stream: StreamKey) {
        self.spaces[from_space].mark_unmapped(from, self.granule);
        self.spaces[to_space].mark_mapped(to, self.granule, stream);
        self.counters.granules_moved += 1;
    }

    /// New memory now backs `[addr, addr + len)`.
    pub fn mapped(&mut self, addr: usize, len: usize, stream: StreamKey) {
        let si = self.space_of(addr);
        self.spaces[si].mark_mapped(addr, len, stream);
        self.counters.granules_mapped += (len / self.granule) as u64;
    }

    /// The memory of `[addr, addr + len)` (whole granules of one free block) went back.
    pub fn unmapped(&mut self, addr: usize, len: usize) {
        let si = self.space_of(addr);
        self.spaces[si].mark_unmapped(addr, len);
        self.counters.granules_unmapped += (len / self.granule) as u64;
    }

    /// Hand out the window of a growth whose granules are all mapped now.
    pub fn carve(&mut self, growth: &Growth, stream: StreamKey) -> Block {
        if !growth.donors.is_empty() {
            self.counters.stitches += 1;
        }
        self.spaces[growth.space].carve_range(growth.window.start, growth.window.len, stream)
    }

    /// Runs of whole free granules, in the order they should go back.
    pub fn releasable(&self, order: ReleaseOrder) -> Vec<space::FreeRun> {
        let mut runs: Vec<space::FreeRun> = self.spaces.iter().flat_map(|s| s.free_granule_runs()).collect();
        match order {
            ReleaseOrder::LargestFirst => runs.sort_unstable_by(|a, b| b.len.cmp(&a.len).then(a.addr.cmp(&b.addr))),
            ReleaseOrder::OldestFirst => runs.sort_unstable_by_key(|r| (r.freed_at, r.addr)),
        }
        runs
    }

    /// Bytes mapped by the books (used + free).
    pub fn mapped_bytes(&self) -> usize {
        self.spaces.iter().map(|s| s.mapped_bytes()).sum()
    }

    pub fn reserved_address_space(&self) -> usize {
        self.spaces.iter().map(|s| s.len).sum()
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

    fn take(&mut self, rounded: usize, stream: StreamKey, reusable: &mut dyn FnMut(StreamKey) -> bool) -> Option<Block> {
        self.spaces[Self::class(rounded)].take(rounded, stream, reusable)
    }

    fn add_segment(&mut self, seg: Segment, _rounded: usize) -> Block {
        // `segment_size` is None, so the pool never gets here; say so loudly if it does.
        panic!("arena: add_segment({seg:?}) called; the arena grows through plan()")
    }

    fn put(&mut self, block: Block) -> Option<Segment> {
        let si = self.space_of(block.addr);
        self.spaces[si].put(block);
        None
    }

    fn drain_free_segments(&mut self, _want: Option<usize>, _order: ReleaseOrder) -> Vec<Segment> {
        Vec::new() // no segments: the pool releases granules (`releasable`)
    }

    fn cached_bytes(&self) -> usize {
        self.spaces.iter().map(|s| s.free_bytes).sum()
    }

    fn free_block_count(&self) -> usize {
        self.spaces.iter().map(|s| s.free_count()).sum()
    }

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
        Ok(())
    }

    fn as_arena(&mut self) -> Option<&mut ArenaStrategy> {
        Some(self)
    }

    fn as_arena_ref(&self) -> Option<&ArenaStrategy> {
        Some(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: usize = 2 << 20;
    const L: StreamKey = StreamKey::LEGACY;

    fn arena() -> ArenaStrategy {
        ArenaStrategy::new((1 << 40, 64 * G), (2 << 40, 256 * G), G)
    }

    /// Run a growth as the pool would with unlimited memory: moves, then new mappings.
    fn grow(a: &mut ArenaStrategy, rounded: usize, stream: StreamKey) -> Block {
        if let Some(b) = a.take(rounded, stream, &mut |_| true) {
            return b;
        }
        let g = a.plan(rounded, stream, &mut |_| true).expect("address space left");
        let mut donors = g.donors.iter();
        for &t in &g.window.targets {
            match donors.next() {
                Some(d) => a.moved(d.space, d.addr, g.space, t, stream),
                None => a.mapped(t, G, stream),
            }
        }
        let b = a.carve(&g, stream);
        a.check_invariants().unwrap();
        b
    }

    #[test]
    fn carves_from_mapped_memory_and_coalesces_across_the_range() {
        let mut a = arena();
        let x = grow(&mut a, 3 * G / 2, L); // 1.5 granules: 2 mapped
        assert_eq!(a.mapped_bytes(), 2 * G);
        let y = grow(&mut a, G / 2 + 512, L); // 512 B more than the mapped half granule left
        assert_eq!(y.addr, x.addr + x.size, "carved right after, in the mapped tail and one new granule");
        assert_eq!(a.mapped_bytes(), 3 * G);
        a.put(x);
        a.put(y);
        a.check_invariants().unwrap();
        assert_eq!(a.free_block_count(), 1, "one free block across what were two blocks");
        assert_eq!(a.largest_free_block(), 3 * G);
        let z = grow(&mut a, 3 * G, L);
        assert_eq!(z.addr, x.addr);
        assert_eq!(a.counters.granules_mapped, 3, "reuse mapped nothing");
    }

    #[test]
    fn scattered_free_granules_are_stitched_not_added() {
        let mut a = arena();
        // Eight 2-granule blocks, free every other one: 8 granules free, no 3 in a row.
        let blocks: Vec<Block> = (0..8).map(|_| grow(&mut a, 2 * G, L)).collect();
        for b in blocks.iter().step_by(2) {
            a.put(*b);
        }
        let mapped = a.mapped_bytes();
        let big = grow(&mut a, 6 * G, L);
        assert_eq!(a.mapped_bytes(), mapped, "no new memory: free granules moved under the window");
        assert_eq!(a.counters.stitches, 1);
        assert_eq!(a.counters.granules_moved, 6);
        // Freed, the window stays mapped: the same request again is a plain take.
        a.put(big);
        let moved = a.counters.granules_moved;
        let again = grow(&mut a, 6 * G, L);
        assert_eq!((again.addr, a.counters.granules_moved), (big.addr, moved));
    }

    #[test]
    fn small_requests_share_granules_in_their_own_space() {
        let mut a = arena();
        let smalls: Vec<Block> = (0..16).map(|_| grow(&mut a, 64 << 10, L)).collect();
        assert_eq!(a.mapped_bytes(), G, "16 x 64 KiB share one granule");
        assert!(smalls.iter().all(|b| a.spaces[SMALL].contains(b.addr)));
        let big = grow(&mut a, 4 << 20, L);
        assert!(a.spaces[LARGE].contains(big.addr));
    }

    #[test]
    fn other_streams_memory_needs_permission() {
        let mut a = arena();
        let x = grow(&mut a, 4 * G, L);
        a.put(Block { stream: StreamKey(7), ..x });
        assert!(a.take(4 * G, L, &mut |_| false).is_none());
        let g = a.plan(4 * G, L, &mut |_| false).unwrap();
        assert_ne!(g.window.start, x.addr, "a refused stream's memory is not in the window");
        assert!(g.donors.iter().all(|d| d.streams == [StreamKey(7)]), "donors carry their stream for the pool to sync");
        let y = a.take(4 * G, L, &mut |s| s == StreamKey(7)).unwrap();
        assert_eq!(y.addr, x.addr);
    }

    #[test]
    fn a_granule_shared_by_two_streams_free_blocks_is_released_after_both() {
        let mut a = arena();
        let x = grow(&mut a, 3 * G / 2, L);
        let y = grow(&mut a, 3 * G / 2, L);
        a.put(x);
        a.put(Block { stream: StreamKey(9), ..y });
        a.check_invariants().unwrap();
        let runs = a.releasable(ReleaseOrder::OldestFirst);
        assert_eq!(runs.len(), 1);
        assert_eq!((runs[0].addr, runs[0].len), (x.addr, 3 * G), "granule 1 holds both blocks' ends");
        assert_eq!(runs[0].streams, vec![L, StreamKey(9)]);
        a.unmapped(runs[0].addr, runs[0].len);
        a.check_invariants().unwrap();
        assert_eq!(a.mapped_bytes(), 0);
    }

    #[test]
    fn release_lists_whole_free_granules_only() {
        let mut a = arena();
        let x = grow(&mut a, 3 * G / 2, L); // granules 0-1, x ends mid-granule 1
        let y = grow(&mut a, 3 * G, L); // from x's end: granules 1-4 (2-4 new)
        assert_eq!((y.addr, a.mapped_bytes()), (x.addr + x.size, 5 * G));
        a.put(y);
        // Granule 1 is shared with the live x: only granules 2-4 can go back.
        let runs = a.releasable(ReleaseOrder::LargestFirst);
        assert_eq!(runs.iter().map(|r| (r.addr, r.len, r.streams.clone())).collect::<Vec<_>>(), vec![(x.addr + 2 * G, 3 * G, vec![L])]);
        for r in runs {
            a.unmapped(r.addr, r.len);
        }
        a.check_invariants().unwrap();
        assert_eq!(a.mapped_bytes(), 2 * G);
        assert_eq!(a.cached_bytes(), G / 2);
    }
}
