//! One address range of the arena and the books of every byte in it.
//!
//! The range is cut into consecutive nodes, each `Allocated` (handed out), `Free` (mapped,
//! cached) or `Unmapped` (reserved address space with no memory behind it). Free and
//! allocated nodes may share a granule (blocks are cut at 512 B, granules are 2 MiB);
//! unmapped nodes are whole granules. So the mapped granules are exactly those covered by
//! free and allocated nodes, and `used + free == mapped` holds at every step.
//!
//! Free nodes merge with free neighbours freed on the same stream, across the whole range
//! (there are no segment boundaries to stop them), and are filed per stream in `FreeBins`
//! for exact best fit. Nodes live in a slab linked by slot, as in `split`, so a free finds
//! its node through `Block::handle` without an address lookup.

use crate::block::Block;
use crate::strategy::bins::FreeBins;
use crate::strategy::slab::{Slab, NIL};
pub use crate::strategy::slab::Slot;
use crate::upstream::stream_id::StreamKey;
use rustc_hash::FxHashMap;

mod invariants;
mod queries;

/// Smallest piece a block is cut to (and the rounding of every request).
pub const ROUND: usize = 512;

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum State {
    Allocated,
    Free,
    Unmapped,
    /// The slot holds no node.
    Vacant,
}

#[derive(Copy, Clone, Debug)]
pub struct Node {
    pub addr: usize,
    pub size: usize,
    pub prev: Slot,
    pub next: Slot,
    pub state: State,
    /// Free: the stream it was freed on; allocated: the stream it was handed to.
    pub stream: StreamKey,
    /// The space's clock when the node last became free (oldest memory is given away first).
    pub freed_at: u64,
}

impl Node {
    pub fn end(&self) -> usize {
        self.addr + self.size
    }
}

/// Whole free granules in a row (`free_granule_runs`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FreeRun {
    pub addr: usize,
    pub len: usize,
    /// Streams that freed memory in it: all must be synchronised before it is unmapped.
    pub streams: Vec<StreamKey>,
    /// The space's clock when its most recent free happened.
    pub freed_at: u64,
}

pub struct Space {
    pub base: usize,
    pub len: usize,
    pub granule: usize,
    slab: Slab<Node>,
    first: Slot,
    index: FxHashMap<StreamKey, FreeBins>,
    free_count: usize,
    /// Bytes in free nodes (mapped, cached).
    pub free_bytes: usize,
    /// Bytes in allocated nodes.
    pub used_bytes: usize,
    clock: u64,
}

impl Space {
    /// A range of `len` bytes at `base` (both granule aligned), all unmapped.
    pub fn new(base: usize, len: usize, granule: usize) -> Space {
        let mut s = Space {
            base,
            len,
            granule,
            slab: Slab::default(),
            first: 0,
            index: FxHashMap::default(),
            free_count: 0,
            free_bytes: 0,
            used_bytes: 0,
            clock: 0,
        };
        s.first = s.slab.alloc(Node {
            addr: base,
            size: len,
            prev: NIL,
            next: NIL,
            state: State::Unmapped,
            stream: StreamKey::LEGACY,
            freed_at: 0,
        });
        s
    }

    pub fn contains(&self, addr: usize) -> bool {
        addr >= self.base && addr < self.base + self.len
    }

    pub fn node(&self, s: Slot) -> &Node {
        &self.slab.nodes[s as usize]
    }

    /// Nodes in address order.
    pub fn walk(&self) -> impl Iterator<Item = (Slot, &Node)> + '_ {
        let mut s = self.first;
        std::iter::from_fn(move || {
            if s == NIL {
                return None;
            }
            let cur = s;
            s = self.slab.nodes[s as usize].next;
            Some((cur, &self.slab.nodes[cur as usize]))
        })
    }

    fn free_slot(&mut self, s: Slot) {
        self.slab.nodes[s as usize].state = State::Vacant;
        self.slab.release(s);
    }

    fn block_of(&self, s: Slot) -> Block {
        let n = &self.slab.nodes[s as usize];
        Block { addr: n.addr, size: n.size, segment: self.base, stream: n.stream, handle: s }
    }

    fn index_insert(&mut self, s: Slot) {
        let n = self.slab.nodes[s as usize];
        self.index.entry(n.stream).or_default().insert(n.size, n.addr, s);
        self.free_count += 1;
        self.free_bytes += n.size;
    }

    fn index_remove(&mut self, s: Slot) {
        let n = self.slab.nodes[s as usize];
        let bins = self.index.get_mut(&n.stream).expect("a free node's stream has an index");
        let removed = bins.remove(n.size, n.addr);
        debug_assert!(removed, "free node missing from the index");
        // Streams come and go; the legacy stream's index is kept (it is the hot path).
        if bins.is_empty() && n.stream != StreamKey::LEGACY {
            self.index.remove(&n.stream);
        }
        self.free_count -= 1;
        self.free_bytes -= n.size;
    }

    /// Insert a new node for `[addr, addr + size)` after `after` (NIL: first).
    fn link_after(&mut self, after: Slot, node: Node) -> Slot {
        let next = if after == NIL { self.first } else { self.slab.nodes[after as usize].next };
        let s = self.slab.alloc(Node { prev: after, next, ..node });
        if next != NIL {
            self.slab.nodes[next as usize].prev = s;
        }
        if after == NIL {
            self.first = s;
        } else {
            self.slab.nodes[after as usize].next = s;
        }
        s
    }

    fn unlink(&mut self, s: Slot) {
        let Node { prev, next, .. } = self.slab.nodes[s as usize];
        if prev != NIL {
            self.slab.nodes[prev as usize].next = next;
        } else {
            self.first = next;
        }
        if next != NIL {
            self.slab.nodes[next as usize].prev = prev;
        }
        self.free_slot(s);
    }

    /// Cut node `s` at `at` (inside it); the back part gets a new slot, returned.
    fn split_at(&mut self, s: Slot, at: usize) -> Slot {
        let n = self.slab.nodes[s as usize];
        debug_assert!(at > n.addr && at < n.end());
        let back = Node { addr: at, size: n.end() - at, ..n };
        self.slab.nodes[s as usize].size = at - n.addr;
        self.link_after(s, back)
    }

    /// Merge `s` (free, or unmapped) with like neighbours; returns the surviving slot.
    /// Free nodes must be out of the index when called; the caller files the result.
    fn merge_neighbours(&mut self, mut s: Slot) -> Slot {
        let alike = |a: &Node, b: &Node| {
            a.state == b.state && (a.state == State::Unmapped || (a.state == State::Free && a.stream == b.stream))
        };
        let next = self.slab.nodes[s as usize].next;
        if next != NIL && alike(&self.slab.nodes[s as usize], &self.slab.nodes[next as usize]) {
            if self.slab.nodes[next as usize].state == State::Free {
                self.index_remove(next);
            }
            self.slab.nodes[s as usize].size += self.slab.nodes[next as usize].size;
            self.unlink(next);
        }
        let prev = self.slab.nodes[s as usize].prev;
        if prev != NIL && alike(&self.slab.nodes[prev as usize], &self.slab.nodes[s as usize]) {
            if self.slab.nodes[prev as usize].state == State::Free {
                self.index_remove(prev);
            }
            self.slab.nodes[prev as usize].size += self.slab.nodes[s as usize].size;
            self.slab.nodes[prev as usize].freed_at = self.slab.nodes[prev as usize].freed_at.max(self.slab.nodes[s as usize].freed_at);
            self.unlink(s);
            s = prev;
        }
        s
    }

    /// Make `s` a free node on `stream`, merged and filed.
    fn make_free(&mut self, s: Slot, stream: StreamKey) {
        self.clock += 1;
        let n = &mut self.slab.nodes[s as usize];
        n.state = State::Free;
        n.stream = stream;
        n.freed_at = self.clock;
        let s = self.merge_neighbours(s);
        self.index_insert(s);
    }

    /// Hand out the first `rounded` bytes of free node `s` to `stream`.
    fn carve(&mut self, s: Slot, rounded: usize, stream: StreamKey) -> Block {
        self.index_remove(s);
        if self.slab.nodes[s as usize].size > rounded {
            let rest = self.split_at(s, self.slab.nodes[s as usize].addr + rounded);
            self.index_insert(rest);
        }
        let n = &mut self.slab.nodes[s as usize];
        n.state = State::Allocated;
        n.stream = stream;
        self.used_bytes += rounded;
        self.block_of(s)
    }

    /// Best fit among mapped free memory: the requesting stream first, then other
    /// streams' (best fit first) where `reusable` allows. No driver call.
    pub fn take(&mut self, rounded: usize, stream: StreamKey, reusable: &mut dyn FnMut(StreamKey, usize, usize) -> bool) -> Option<Block> {
        if let Some((_, _, s)) = self.index.get(&stream).and_then(|b| b.best_fit(rounded)) {
            return Some(self.carve(s, rounded, stream));
        }
        let mut cands: Vec<(usize, usize, Slot, StreamKey)> = self
            .index
            .iter()
            .filter(|(k, _)| **k != stream)
            .filter_map(|(k, b)| b.best_fit(rounded).map(|(size, addr, s)| (size, addr, s, *k)))
            .collect();
        cands.sort_unstable();
        for (size, addr, s, from) in cands {
            if reusable(from, addr, size) {
                return Some(self.carve(s, rounded, stream));
            }
        }
        None
    }

    /// `take` for a crumb that must pin no granule not pinned already: among free nodes
    /// smaller than a granule, only one whose first `rounded` bytes lie in granules that a
    /// live block also occupies (the rest of a granule under a large block, which no loan,
    /// release or stitch could use while that block lives). Own stream first (no permission
    /// needed), then the others, best fit first, a few fits per stream.
    pub fn take_scrap(&mut self, rounded: usize, stream: StreamKey, reusable: &mut dyn FnMut(StreamKey, usize, usize) -> bool) -> Option<Block> {
        const FITS_PER_STREAM: usize = 8;
        let mut cands: Vec<(bool, usize, usize, Slot, StreamKey)> = Vec::new();
        for (&k, bins) in &self.index {
            let mut fit = bins.best_fit(rounded);
            for _ in 0..FITS_PER_STREAM {
                let Some((size, addr, s)) = fit.filter(|e| e.0 < self.granule) else { break };
                if self.pinned_by_live(s, rounded) {
                    cands.push((k != stream, size, addr, s, k));
                    break;
                }
                fit = bins.next_fit(rounded, (size, addr));
            }
        }
        cands.sort_unstable_by_key(|&(foreign, size, addr, ..)| (foreign, size, addr));
        for (_, size, addr, s, from) in cands {
            if from == stream || reusable(from, addr, size) {
                return Some(self.carve(s, rounded, stream));
            }
        }
        None
    }

    /// Whether every granule that the first `len` bytes of node `s` touch also holds an
    /// allocated node. Walks the neighbours of `s` (a granule holds at most
    /// `granule / ROUND` nodes).
    fn pinned_by_live(&self, s: Slot, len: usize) -> bool {
        let g = self.granule;
        let start = self.slab.nodes[s as usize].addr;
        let (lo, hi) = (start / g * g, (start + len).div_ceil(g) * g);
        let mut pinned = [false; 2]; // a crumb under a granule touches at most two granules
        let mut mark = |n: &Node| {
            if n.state == State::Allocated {
                for (i, p) in pinned.iter_mut().enumerate() {
                    let gs = lo + i * g;
                    if gs < hi && n.addr < gs + g && n.end() > gs {
                        *p = true;
                    }
                }
            }
        };
        let mut p = self.slab.nodes[s as usize].prev;
        while p != NIL && self.slab.nodes[p as usize].end() > lo {
            mark(&self.slab.nodes[p as usize]);
            p = self.slab.nodes[p as usize].prev;
        }
        let mut n = self.slab.nodes[s as usize].next;
        while n != NIL && self.slab.nodes[n as usize].addr < hi {
            mark(&self.slab.nodes[n as usize]);
            n = self.slab.nodes[n as usize].next;
        }
        (0..(hi - lo) / g).all(|i| pinned[i])
    }

    /// Take back an allocated block freed on `block.stream`.
    pub fn put(&mut self, block: Block) {
        let s = block.handle;
        debug_assert!(self.slab.nodes.get(s as usize).is_some_and(|n| n.addr == block.addr && n.state == State::Allocated));
        self.used_bytes -= self.slab.nodes[s as usize].size;
        self.make_free(s, block.stream);
    }

    /// The node holding `addr`, by walking (planning and tests only: not the hot path).
    fn node_at(&self, addr: usize) -> Option<Slot> {
        self.walk().find(|(_, n)| n.addr <= addr && addr < n.end()).map(|(s, _)| s)
    }

    /// Make `addr` the start of a node (splitting the one holding it; a free node's pieces
    /// stay filed). Returns that node.
    fn cut_at(&mut self, addr: usize) -> Slot {
        let s = self.node_at(addr).expect("address inside the space");
        if self.slab.nodes[s as usize].addr == addr {
            return s;
        }
        let free = self.slab.nodes[s as usize].state == State::Free;
        if free {
            self.index_remove(s);
        }
        let back = self.split_at(s, addr);
        if free {
            self.index_insert(s);
            self.index_insert(back);
        }
        back
    }

    /// Granules `[addr, addr + len)` of an unmapped node were mapped: they become free
    /// memory of `stream` (fresh memory has no pending work on any stream).
    pub fn mark_mapped(&mut self, addr: usize, len: usize, stream: StreamKey) {
        if addr + len < self.base + self.len {
            self.cut_at(addr + len);
        }
        let s = self.cut_at(addr);
        // Off the hot path: a broken plan must stop here, not corrupt the books.
        assert!(self.slab.nodes[s as usize].state == State::Unmapped && self.slab.nodes[s as usize].size == len, "arena: mapped range not unmapped");
        self.make_free(s, stream);
    }

    /// Granules `[addr, addr + len)`, all free (possibly across nodes of several streams),
    /// were unmapped.
    pub fn mark_unmapped(&mut self, addr: usize, len: usize) {
        if addr + len < self.base + self.len {
            self.cut_at(addr + len);
        }
        let mut s = self.cut_at(addr);
        while s != NIL && self.slab.nodes[s as usize].addr < addr + len {
            assert_eq!(self.slab.nodes[s as usize].state, State::Free, "arena: unmapping memory that is not free");
            self.index_remove(s);
            self.slab.nodes[s as usize].state = State::Unmapped;
            s = self.merge_neighbours(s);
            s = self.slab.nodes[s as usize].next;
        }
    }

    /// Hand out `[addr, addr + rounded)`, which lies wholly in free nodes (of streams the
    /// pool made safe for `stream`): they merge into one node of `stream`, cut around it.
    pub fn carve_range(&mut self, addr: usize, rounded: usize, stream: StreamKey) -> Block {
        // Cut the leftovers off first, so they keep the stream (and age) of the memory they
        // were: only the window itself becomes the requester's.
        let end = addr + rounded;
        if end < self.base + self.len {
            self.cut_at(end);
        }
        let s = self.cut_at(addr);
        assert_eq!(self.slab.nodes[s as usize].state, State::Free, "arena: window starts in a non-free node");
        self.index_remove(s);
        while self.slab.nodes[s as usize].end() < end {
            let next = self.slab.nodes[s as usize].next;
            assert_eq!(self.slab.nodes[next as usize].state, State::Free, "arena: window crosses a non-free node");
            self.index_remove(next);
            self.slab.nodes[s as usize].size += self.slab.nodes[next as usize].size;
            self.unlink(next);
        }
        let n = &mut self.slab.nodes[s as usize];
        n.state = State::Allocated;
        n.stream = stream;
        self.used_bytes += rounded;
        self.block_of(s)
    }
}
