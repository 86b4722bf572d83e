//! `split`: best fit with splitting and coalescing.
//!
//! - Requests are rounded to 512 B.
//! - Small requests (<= 1 MiB) and large ones live in separate classes: small ones are cut
//!   from 2 MiB segments, so they never fragment the segments that serve large tensors.
//!   Large requests below 10 MiB get 20 MiB segments (amortises upstream calls), larger
//!   ones exactly their size rounded to 2 MiB. (These are PyTorch's measured choices.)
//! - Best fit per stream: the smallest free block of the request's class that fits, first
//!   on the requesting stream, then on other streams (which the pool must make safe). The
//!   index is `bins.rs` (exact best fit without a tree walk).
//! - Splitting: small blocks split when at least 512 B remain; large ones only when more
//!   than 1 MiB remains (a smaller tail would be a small block stranded in a large segment).
//! - Coalescing: a freed block merges with free neighbours of the same segment and stream;
//!   never across segments (upstream allocations are released whole).
//! - Exact-size fast path: a freed block first goes to a small LIFO cache keyed by
//!   (stream, size) without coalescing; an identical request takes it back in O(1). Any
//!   other request first flushes (coalesces) the cache, so best fit sees the same free
//!   blocks eager coalescing would give: the cache costs neither fit quality nor memory.
//! - Bookkeeping: one node per block in a slab (a `Vec` with a free list); neighbours link
//!   by slot and each handed-out `Block` carries its slot (`Block::handle`), so a step of
//!   take, split, free and coalesce does no address hashing. With `bins.rs` this halves a
//!   churn step (free a random block, allocate a random size) against address-keyed maps
//!   and an ordered set (`cargo bench --bench malloc_free -- churn`).

use super::bins::FreeBins;
use super::{ReleaseOrder, Strategy};
use crate::block::{round_up, Block, Segment};
use crate::upstream::stream_id::StreamKey;
use rustc_hash::FxHashMap;
use std::collections::hash_map::Entry;

mod invariants;

pub const ROUND: usize = 512;
pub const SMALL_LIMIT: usize = 1 << 20;
pub const SMALL_SEGMENT: usize = 2 << 20;
pub const MID_LIMIT: usize = 10 << 20;
pub const MID_SEGMENT: usize = 20 << 20;
pub const LARGE_ROUND: usize = 2 << 20;
const QUICK_MAX: usize = 64;
/// Free blocks of one other stream asked for in a take before that stream is passed over
/// (each refusal costs no driver call; a wait may cost one).
const FITS_ASKED_PER_STREAM: usize = 4;

/// Emptied free indexes of non-legacy streams kept for reuse. Building one costs a few KiB
/// (`bins.rs`), too much to pay each time a busy stream's last free block is taken; beyond
/// this many they are dropped, so a program that creates many streams does not accumulate
/// them. The legacy stream's are always kept.
const EMPTY_INDEXES_KEPT: usize = 16;

use super::slab::{Slab, Slot, NIL};

#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Class {
    Small,
    Large,
}

fn class_of(rounded: usize) -> Class {
    if rounded <= SMALL_LIMIT {
        Class::Small
    } else {
        Class::Large
    }
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum State {
    /// Handed out, or parked in the exact-size cache (which the node does not know about:
    /// the fast path touches no node).
    Allocated,
    Free,
    /// The slot holds no block (on the slab's free list).
    Vacant,
}

#[derive(Copy, Clone, Debug)]
struct Node {
    addr: usize,
    size: usize,
    /// Slots of the previous / next block in the same segment.
    prev: Slot,
    next: Slot,
    segment: usize,
    /// The segment's class (kept here so the index needs no segment lookup).
    class: Class,
    stream: StreamKey,
    state: State,
    /// The strategy's clock when this block last became free (page decommit goes to the
    /// longest idle first).
    freed_at: u64,
}

#[derive(Copy, Clone, Debug)]
struct SegInfo {
    size: usize,
    class: Class,
    /// Slot of the segment's first block.
    first: Slot,
}

/// A free block in the index: (class, stream, size, addr, slot).
type FreeKey = (Class, StreamKey, usize, usize, Slot);

#[derive(Default)]
pub struct SplitStrategy {
    /// The nodes, by slot.
    slab: Slab<Node>,
    /// Free blocks per (class, stream); emptied ones stay up to `EMPTY_INDEXES_KEPT`.
    free_index: FxHashMap<(Class, StreamKey), FreeBins>,
    /// Empty indexes of non-legacy streams now in `free_index`.
    empty_kept: usize,
    free_count: usize,
    segments: FxHashMap<usize, SegInfo>,
    /// Exact-size cache, LIFO: (stream, size, addr, segment, slot). A flat list: it holds at
    /// most `QUICK_MAX` entries and a hit is nearly always the last one.
    quick: Vec<(StreamKey, usize, usize, usize, Slot)>,
    cached: usize,
    /// Operations so far (takes + puts): the clock of `Node::freed_at`.
    clock: u64,
}

impl SplitStrategy {
    pub fn new() -> Self {
        Self::default()
    }

    fn free_slot(&mut self, s: Slot) {
        self.slab.nodes[s as usize].state = State::Vacant;
        self.slab.release(s);
    }

    fn block_of(&self, s: Slot) -> Block {
        let n = &self.slab.nodes[s as usize];
        Block { addr: n.addr, size: n.size, segment: n.segment, stream: n.stream, handle: s }
    }

    fn index_insert(&mut self, s: Slot) {
        let n = &self.slab.nodes[s as usize];
        let set = match self.free_index.entry((n.class, n.stream)) {
            Entry::Occupied(e) => {
                if e.get().is_empty() && n.stream != StreamKey::LEGACY {
                    self.empty_kept -= 1; // a kept empty index is in use again
                }
                e.into_mut()
            }
            Entry::Vacant(e) => e.insert(FreeBins::default()),
        };
        set.insert(n.size, n.addr, s);
        self.free_count += 1;
    }

    fn index_remove(&mut self, s: Slot) {
        let n = &self.slab.nodes[s as usize];
        let key = (n.class, n.stream);
        let set = self.free_index.get_mut(&key).expect("stream has a free set");
        let removed = set.remove(n.size, n.addr);
        debug_assert!(removed, "free block missing from index");
        if set.is_empty() && key.1 != StreamKey::LEGACY {
            if self.empty_kept < EMPTY_INDEXES_KEPT {
                self.empty_kept += 1;
            } else {
                self.free_index.remove(&key);
            }
        }
        self.free_count -= 1;
    }

    fn best_fit(&self, class: Class, stream: StreamKey, rounded: usize) -> Option<FreeKey> {
        let (size, addr, slot) = self.free_index.get(&(class, stream))?.best_fit(rounded)?;
        Some((class, stream, size, addr, slot))
    }

    /// Hand out (part of) the indexed free block `key` for `stream`.
    fn carve(&mut self, key: FreeKey, rounded: usize, stream: StreamKey) -> Block {
        let (class, _, size, addr, s) = key;
        self.index_remove(s);
        let node = self.slab.nodes[s as usize];
        let rest = size - rounded;
        let min_rest = if class == Class::Small { ROUND } else { SMALL_LIMIT + 1 };
        let taken = if rest >= min_rest {
            let rest_node = Node { addr: addr + rounded, size: rest, prev: s, next: node.next, state: State::Free, ..node };
            let r = self.slab.alloc(rest_node);
            if node.next != NIL {
                self.slab.nodes[node.next as usize].prev = r;
            }
            self.index_insert(r);
            let n = &mut self.slab.nodes[s as usize];
            n.size = rounded;
            n.next = r;
            rounded
        } else {
            size
        };
        let n = &mut self.slab.nodes[s as usize];
        n.state = State::Allocated;
        n.stream = stream;
        self.cached -= taken;
        self.block_of(s)
    }

    /// Free slot `s` for real: coalesce with free neighbours, then index it.
    fn free_now(&mut self, s: Slot) {
        let mut node = self.slab.nodes[s as usize];
        let mut start = s;
        if node.next != NIL {
            let nx = node.next;
            let next = self.slab.nodes[nx as usize];
            if next.state == State::Free && next.stream == node.stream {
                self.index_remove(nx);
                self.free_slot(nx);
                node.size += next.size;
                node.next = next.next;
                if next.next != NIL {
                    self.slab.nodes[next.next as usize].prev = start;
                }
            }
        }
        if node.prev != NIL {
            let pv = node.prev;
            let prev = self.slab.nodes[pv as usize];
            if prev.state == State::Free && prev.stream == node.stream {
                self.index_remove(pv);
                self.free_slot(start);
                start = pv;
                node = Node { addr: prev.addr, size: prev.size + node.size, prev: prev.prev, ..node };
                if node.next != NIL {
                    self.slab.nodes[node.next as usize].prev = start;
                }
            }
        }
        node.state = State::Free;
        node.freed_at = self.clock;
        self.slab.nodes[start as usize] = node;
        self.index_insert(start);
    }

    fn flush_quick(&mut self) -> bool {
        if self.quick.is_empty() {
            return false;
        }
        // Take the list out (keeping its capacity) so free_now can borrow self.
        let mut quick = std::mem::take(&mut self.quick);
        for (stream, _, _, _, s) in quick.drain(..) {
            self.slab.nodes[s as usize].stream = stream;
            self.free_now(s);
        }
        self.quick = quick;
        true
    }

    /// Slots of every node in `state` (reports and scans; not the hot path).
    fn slots_in(&self, state: State) -> impl Iterator<Item = Slot> + '_ {
        (0..self.slab.nodes.len() as Slot).filter(move |&s| self.slab.nodes[s as usize].state == state)
    }
}

impl Strategy for SplitStrategy {
    fn name(&self) -> &'static str {
        "split"
    }

    fn round(&self, size: usize) -> Option<usize> {
        // Above isize::MAX no upstream can serve it; say so before any arithmetic can wrap.
        round_up(size, ROUND).filter(|&s| s <= isize::MAX as usize)
    }

    fn segment_size(&self, rounded: usize) -> Option<usize> {
        if rounded <= SMALL_LIMIT {
            Some(SMALL_SEGMENT)
        } else if rounded < MID_LIMIT {
            Some(MID_SEGMENT)
        } else {
            round_up(rounded, LARGE_ROUND)
        }
    }

    fn take(&mut self, rounded: usize, stream: StreamKey, reusable: &mut dyn FnMut(StreamKey, usize, usize) -> bool) -> Option<Block> {
        self.clock += 1;
        if !self.quick.is_empty() {
            if let Some(i) = self.quick.iter().rposition(|q| q.0 == stream && q.1 == rounded) {
                let (_, _, addr, segment, handle) = self.quick.remove(i);
                self.cached -= rounded;
                return Some(Block { addr, size: rounded, segment, stream, handle });
            }
            // A miss coalesces the deferred frees first, so best fit below sees exactly
            // what eager coalescing would have produced: the cache never costs fit quality.
            self.flush_quick();
        }
        let class = class_of(rounded);
        if let Some(key) = self.best_fit(class, stream, rounded) {
            return Some(self.carve(key, rounded, stream));
        }
        // Other streams' blocks, best fit first; each needs the pool's permission. A refused
        // block may be one its stream freed after its last event record (`crate::stream`)
        // while older ones of that stream are covered: the next few fits of that stream are
        // asked too, in the same best-first order.
        let mut cands: Vec<(FreeKey, usize)> = self
            .free_index
            .keys()
            .filter(|(c, s)| *c == class && *s != stream)
            .filter_map(|&(c, s)| self.best_fit(c, s, rounded))
            .map(|k| (k, 1))
            .collect();
        while let Some(i) = (0..cands.len()).min_by_key(|&i| (cands[i].0 .2, cands[i].0 .3)) {
            let (key, tries) = cands[i];
            if reusable(key.1, key.3, key.2) {
                return Some(self.carve(key, rounded, stream));
            }
            let next = (tries < FITS_ASKED_PER_STREAM)
                .then(|| self.free_index.get(&(class, key.1))?.next_fit(rounded, (key.2, key.3)))
                .flatten();
            match next {
                Some((size, addr, slot)) => cands[i] = ((class, key.1, size, addr, slot), tries + 1),
                None => {
                    cands.swap_remove(i);
                }
            }
        }
        None
    }

    fn add_segment(&mut self, seg: Segment, rounded: usize) -> Block {
        let class = class_of(rounded);
        let s = self.slab.alloc(Node {
            addr: seg.base,
            size: seg.size,
            prev: NIL,
            next: NIL,
            segment: seg.base,
            class,
            stream: seg.stream,
            state: State::Free,
            freed_at: self.clock,
        });
        self.segments.insert(seg.base, SegInfo { size: seg.size, class, first: s });
        self.index_insert(s);
        self.cached += seg.size;
        self.carve((class, seg.stream, seg.size, seg.base, s), rounded, seg.stream)
    }

    fn put(&mut self, b: Block) -> Option<Segment> {
        self.clock += 1;
        self.cached += b.size;
        debug_assert!(
            self.slab.nodes.get(b.handle as usize).is_some_and(|n| n.addr == b.addr && n.state == State::Allocated),
            "pool passes only blocks it got from us"
        );
        if self.quick.len() < QUICK_MAX {
            self.quick.push((b.stream, b.size, b.addr, b.segment, b.handle));
        } else {
            self.slab.nodes[b.handle as usize].stream = b.stream;
            self.free_now(b.handle);
        }
        None
    }

    fn flush_deferred(&mut self) -> bool {
        self.flush_quick()
    }

    fn drain_free_segments(&mut self, want: Option<usize>, order: ReleaseOrder, releasable: &mut dyn FnMut(StreamKey) -> bool) -> Vec<Segment> {
        self.flush_quick();
        self.free_index.retain(|_, set| !set.is_empty());
        self.empty_kept = 0;
        // Wholly free segments: one free block, or several free blocks that did not merge
        // because different streams freed them (released too: the pool then waits for
        // every stream, `StreamKey::MIXED`).
        let mut all_free = |info: &SegInfo| {
            let mut slot = info.first;
            while slot != NIL {
                let n = &self.slab.nodes[slot as usize];
                if n.state != State::Free || !releasable(n.stream) {
                    return false;
                }
                slot = n.next;
            }
            true
        };
        let mut whole: Vec<(usize, SegInfo)> =
            self.segments.iter().filter(|(_, info)| all_free(info)).map(|(b, i)| (*b, *i)).collect();
        match order {
            ReleaseOrder::LargestFirst => whole.sort_unstable_by(|a, b| b.1.size.cmp(&a.1.size).then(a.0.cmp(&b.0))),
            ReleaseOrder::OldestFirst => {
                whole.sort_unstable_by_key(|&(base, info)| (self.slab.nodes[info.first as usize].freed_at, base))
            }
        }
        let mut out = Vec::new();
        let mut got = 0;
        for (base, info) in whole {
            let mut stream = self.slab.nodes[info.first as usize].stream;
            let mut slot = info.first;
            while slot != NIL {
                let next = self.slab.nodes[slot as usize].next;
                if self.slab.nodes[slot as usize].stream != stream {
                    stream = StreamKey::MIXED;
                }
                self.index_remove(slot);
                self.free_slot(slot);
                slot = next;
            }
            self.segments.remove(&base);
            self.cached -= info.size;
            got += info.size;
            out.push(Segment { base, size: info.size, stream });
            if want.is_some_and(|w| got >= w) {
                break;
            }
        }
        out
    }

    fn cached_bytes(&self) -> usize {
        self.cached
    }

    fn free_block_count(&self) -> usize {
        self.free_count + self.quick.len()
    }

    fn largest_free_block(&self) -> usize {
        let indexed = self.free_index.values().filter_map(|s| s.largest().map(|k| k.0)).max().unwrap_or(0);
        let quick = self.quick.iter().map(|q| q.1).max().unwrap_or(0);
        indexed.max(quick)
    }

    fn free_blocks(&self) -> Vec<Block> {
        let free = self.slots_in(State::Free).map(|s| self.block_of(s));
        let quick =
            self.quick.iter().map(|&(stream, size, addr, segment, handle)| Block { addr, size, segment, stream, handle });
        free.chain(quick).collect()
    }

    fn decommit_candidates(&mut self) -> Vec<Block> {
        self.flush_quick();
        let mut idle: Vec<(u64, Block)> =
            self.slots_in(State::Free).map(|s| (self.slab.nodes[s as usize].freed_at, self.block_of(s))).collect();
        // Longest idle first (least likely to be wanted soon), then largest.
        idle.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.size.cmp(&a.1.size)).then(a.1.addr.cmp(&b.1.addr)));
        idle.into_iter().map(|(_, b)| b).collect()
    }

    fn segment_len(&self, base: usize) -> Option<usize> {
        self.segments.get(&base).map(|s| s.size)
    }

    fn is_free_block(&self, addr: usize) -> bool {
        self.slots_in(State::Free).any(|s| self.slab.nodes[s as usize].addr == addr) || self.quick.iter().any(|q| q.2 == addr)
    }

    fn check_invariants(&self) -> Result<(), String> {
        self.check_books()
    }
}
