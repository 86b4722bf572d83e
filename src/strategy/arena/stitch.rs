//! Stitched ranges: free granules scattered over the large-block space, mapped a second
//! time side by side in a range of their own, so one request larger than any free block
//! gets contiguous addresses without new memory (GMLake's idea).
//!
//! A stitch keeps its aliases after its block is freed. The next request of at most its
//! size that finds enough of its granules in a row free again takes them with no driver
//! call: a training step that repeats stitches once, not every step, and one stitch made
//! at the longest sequence serves the shorter ones. While a stitch is handed out (to one
//! block at a time), the home granules of that block are booked as allocated in their
//! space, so nothing else gets them; when it is freed they become free there again.
//!
//! This file keeps the books (address space for stitches, which home granules each
//! shows); the pool makes the driver calls (`pool/grow.rs`, `pool/release.rs`).

use std::collections::BTreeMap;

use super::space::Slot;
use rustc_hash::FxHashMap;

/// At most this many stitches are kept; past it, the least recently used free one goes.
pub const MAX_STITCHES: usize = 256;

#[derive(Clone, Debug)]
pub struct Stitch {
    pub base: usize,
    pub len: usize,
    /// Home granule addresses (in the large space), in the order they appear here.
    pub homes: Vec<usize>,
    /// While handed out: the home nodes booked for it (one per run of adjacent homes).
    pub borrowed: Vec<Slot>,
    pub in_use: bool,
    /// While handed out: the granules handed out, `homes[first_in_use..][..granules_in_use]`
    /// (a stitch serves any smaller request with any run of its granules that is free).
    pub first_in_use: usize,
    pub granules_in_use: usize,
    /// While handed out: the bytes handed out, from the first of those granules; the rest
    /// of the last one is free memory of its home.
    pub bytes_in_use: usize,
    /// While handed out: what its last granule holds past the block, booked with it
    /// (counted as cached); 0 where the block ends in a piece.
    pub tail_in_use: usize,
    /// While handed out: whether it begins or ends in pieces of granules partly in use
    /// (`ArenaStrategy::carve_pieced_stitch`), booked in part.
    pub pieced: bool,
    /// The cache's clock at its last use (least recently used goes first).
    pub last_used: u64,
    /// The stream its block was last freed on (work there may still use the aliases).
    pub last_stream: Option<crate::upstream::stream_id::StreamKey>,
    /// Set when removing its aliases failed after the first `unaliased` of them: it is
    /// never handed out again, and the removal resumes there.
    pub broken: bool,
    pub unaliased: usize,
}

pub struct Stitches {
    pub base: usize,
    pub len: usize,
    /// Unused address space of the stitch range: start -> length.
    free_va: BTreeMap<usize, usize>,
    entries: Vec<Option<Stitch>>,
    vacant: Vec<u32>,
    /// Home granule -> stitches that show it.
    by_home: FxHashMap<usize, Vec<u32>>,
    clock: u64,
}

impl Stitches {
    pub fn new(base: usize, len: usize) -> Stitches {
        let mut free_va = BTreeMap::new();
        if len > 0 {
            free_va.insert(base, len);
        }
        Stitches { base, len, free_va, entries: Vec::new(), vacant: Vec::new(), by_home: FxHashMap::default(), clock: 0 }
    }

    pub fn contains(&self, addr: usize) -> bool {
        addr >= self.base && addr < self.base + self.len
    }

    pub fn count(&self) -> usize {
        self.entries.len() - self.vacant.len()
    }

    pub fn get(&self, id: u32) -> &Stitch {
        self.entries[id as usize].as_ref().expect("a live stitch id")
    }

    pub fn get_mut(&mut self, id: u32) -> &mut Stitch {
        self.entries[id as usize].as_mut().expect("a live stitch id")
    }

    /// Address space for a new stitch of `len` bytes (first fit), or `None` when full.
    pub fn find_va(&self, len: usize) -> Option<usize> {
        self.free_va.iter().find(|(_, &l)| l >= len).map(|(&a, _)| a)
    }

    /// Whether `len` bytes could ever fit once every evictable stitch is gone: the range less
    /// what stitches in use or broken hold (evicting cannot free those). Eviction for a
    /// request past this would empty the cache and still fail.
    pub fn could_hold(&self, len: usize) -> bool {
        let pinned: usize = self.iter().filter(|(_, s)| s.in_use || s.broken).map(|(_, s)| s.len).sum();
        len <= self.len - pinned
    }

    /// Book a new stitch at `base` (from `find_va`) showing `homes`; returns its id.
    pub fn add(&mut self, base: usize, homes: Vec<usize>, granule: usize) -> u32 {
        let len = homes.len() * granule;
        let free_len = self.free_va.remove(&base).expect("base from find_va");
        if free_len > len {
            self.free_va.insert(base + len, free_len - len);
        }
        self.clock += 1;
        let st = Stitch { base, len, homes, borrowed: Vec::new(), in_use: false,
            first_in_use: 0,
            granules_in_use: 0,
            bytes_in_use: 0,
            tail_in_use: 0,
            pieced: false,
            last_used: self.clock,
            last_stream: None,
            broken: false,
            unaliased: 0,
        };
        let id = match self.vacant.pop() {
            Some(id) => {
                self.entries[id as usize] = Some(st);
                id
            }
            None => {
                self.entries.push(Some(st));
                (self.entries.len() - 1) as u32
            }
        };
        for &h in &self.get(id).homes.clone() {
            self.by_home.entry(h).or_default().push(id);
        }
        id
    }

    /// Forget stitch `id` (not in use; the pool removed its aliases). Returns it.
    pub fn remove(&mut self, id: u32) -> Stitch {
        let st = self.entries[id as usize].take().expect("a live stitch id");
        debug_assert!(!st.in_use);
        self.vacant.push(id);
        for h in &st.homes {
            if let Some(v) = self.by_home.get_mut(h) {
                v.retain(|&x| x != id);
                if v.is_empty() {
                    self.by_home.remove(h);
                }
            }
        }
        self.give_back_va(st.base, st.len);
        st
    }

    fn give_back_va(&mut self, start: usize, len: usize) {
        let (mut start, mut len) = (start, len);
        if let Some((&a, &l)) = self.free_va.range(..start).next_back() {
            if a + l == start {
                self.free_va.remove(&a);
                start = a;
                len += l;
            }
        }
        if let Some(l) = self.free_va.remove(&(start + len)) {
            len += l;
        }
        self.free_va.insert(start, len);
    }

    /// Stitches showing any granule of `[addr, addr + len)`.
    pub fn over(&self, addr: usize, len: usize, granule: usize) -> Vec<u32> {
        let mut ids: Vec<u32> = (addr..addr + len)
            .step_by(granule)
            .filter_map(|g| self.by_home.get(&g))
            .flatten()
            .copied()
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// Free stitches of at least `min` bytes, smallest first (most recently used first
    /// among equals).
    pub fn candidates(&self, min: usize) -> Vec<u32> {
        let mut c: Vec<(usize, u64, u32)> = self
            .entries
            .iter()
            .enumerate()
            .filter_map(|(i, e)| e.as_ref().map(|s| (i as u32, s)))
            .filter(|(_, s)| !s.in_use && !s.broken && s.len >= min)
            .map(|(i, s)| (s.len, u64::MAX - s.last_used, i))
            .collect();
        c.sort_unstable();
        c.into_iter().map(|x| x.2).collect()
    }

    /// The least recently used free stitch.
    pub fn least_recently_used(&self) -> Option<u32> {
        self.entries
            .iter()
            .enumerate()
            .filter_map(|(i, e)| e.as_ref().filter(|s| !s.in_use && !s.broken).map(|s| (s.last_used, i as u32)))
            .min()
            .map(|x| x.1)
    }

    pub fn touch(&mut self, id: u32) {
        self.clock += 1;
        let c = self.clock;
        self.get_mut(id).last_used = c;
    }

    pub fn iter(&self) -> impl Iterator<Item = (u32, &Stitch)> + '_ {
        self.entries.iter().enumerate().filter_map(|(i, e)| e.as_ref().map(|s| (i as u32, s)))
    }

    pub fn check_invariants(&self) -> Result<(), String> {
        let mut spans: Vec<(usize, usize)> = self.iter().map(|(_, s)| (s.base, s.len)).collect();
        spans.extend(self.free_va.iter().map(|(&a, &l)| (a, l)));
        spans.sort_unstable();
        let mut at = self.base;
        for (a, l) in spans {
            if a != at {
                return Err(format!("stitch range: gap or overlap at {at:#x} (next span {a:#x})"));
            }
            at = a + l;
        }
        if self.len > 0 && at != self.base + self.len {
            return Err(format!("stitch range covered up to {at:#x} of {:#x}", self.base + self.len));
        }
        for (id, s) in self.iter() {
            if s.in_use == s.borrowed.is_empty() {
                return Err(format!("stitch {id}: in use {} with {} borrowed nodes", s.in_use, s.borrowed.len()));
            }
            if s.homes.iter().any(|h| !self.by_home.get(h).is_some_and(|v| v.contains(&id))) {
                return Err(format!("stitch {id}: a home granule is not indexed"));
            }
        }
        Ok(())
    }
}
