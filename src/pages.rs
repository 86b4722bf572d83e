//! Decommitted pages: physical memory given back from inside segments that stay reserved.
//!
//! Upstreams that map memory page by page (`vmm` on the GPU, `host` and the replay's
//! simulated device) can release the pages of a free block without releasing its segment.
//! That is what lets a pool whose free space is scattered between live blocks still give
//! memory back (a non-moving pool can otherwise only release segments that are wholly free).
//! This file only keeps the books: which pages of which segment are decommitted. The pool
//! decides when (`decay.rs`, reclaim) and recommits a block's pages before handing it out.

use rustc_hash::FxHashMap;
use std::collections::BTreeSet;

#[derive(Default)]
pub struct Holes {
    /// Page size of the upstream (a power of two); 0 = the upstream cannot decommit.
    page: usize,
    /// Segment base -> start addresses of its decommitted pages.
    by_segment: FxHashMap<usize, BTreeSet<usize>>,
    bytes: usize,
}

impl Holes {
    pub fn new(page: usize) -> Holes {
        debug_assert!(page == 0 || page.is_power_of_two());
        Holes { page, ..Default::default() }
    }

    /// Whether the upstream can decommit at all.
    pub fn supported(&self) -> bool {
        self.page != 0
    }

    /// No page anywhere is decommitted (the hot path checks only this).
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// Decommitted bytes in all segments.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The whole pages inside `[addr, addr + len)`, as `(first page, end)`; `None` if none.
    pub fn interior(&self, addr: usize, len: usize) -> Option<(usize, usize)> {
        if self.page == 0 {
            return None;
        }
        let start = addr.checked_add(self.page - 1)? & !(self.page - 1);
        let end = (addr + len) & !(self.page - 1);
        (start < end).then_some((start, end))
    }

    /// Runs `(start, len)` of decommitted pages of `segment` that overlap `[addr, addr+len)`.
    pub fn missing_runs(&self, segment: usize, addr: usize, len: usize) -> Vec<(usize, usize)> {
        let Some(set) = self.by_segment.get(&segment) else { return Vec::new() };
        let first = addr & !(self.page - 1);
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for &p in set.range(first..addr + len) {
            match runs.last_mut() {
                Some((s, l)) if *s + *l == p => *l += self.page,
                _ => runs.push((p, self.page)),
            }
        }
        runs
    }

    /// Pages of `[start, end)` (page aligned, inside `segment`) not yet decommitted, as runs.
    pub fn committed_runs(&self, segment: usize, start: usize, end: usize) -> Vec<(usize, usize)> {
        let set = self.by_segment.get(&segment);
        let mut runs: Vec<(usize, usize)> = Vec::new();
        let mut p = start;
        while p < end {
            if !set.is_some_and(|s| s.contains(&p)) {
                match runs.last_mut() {
                    Some((s, l)) if *s + *l == p => *l += self.page,
                    _ => runs.push((p, self.page)),
                }
            }
            p += self.page;
        }
        runs
    }

    pub fn mark_decommitted(&mut self, segment: usize, start: usize, len: usize) {
        let set = self.by_segment.entry(segment).or_default();
        for p in (start..start + len).step_by(self.page) {
            if set.insert(p) {
                self.bytes += self.page;
            }
        }
    }

    pub fn mark_committed(&mut self, segment: usize, start: usize, len: usize) {
        if let Some(set) = self.by_segment.get_mut(&segment) {
            for p in (start..start + len).step_by(self.page) {
                if set.remove(&p) {
                    self.bytes -= self.page;
                }
            }
            if set.is_empty() {
                self.by_segment.remove(&segment);
            }
        }
    }

    /// Forget a segment that goes back to the upstream; returns its decommitted bytes.
    pub fn remove_segment(&mut self, segment: usize) -> usize {
        let n = self.by_segment.remove(&segment).map_or(0, |s| s.len() * self.page);
        self.bytes -= n;
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn books_pages_and_runs() {
        let mut h = Holes::new(0x1000);
        assert_eq!(h.interior(0x10100, 0x2f00), Some((0x11000, 0x13000)));
        assert_eq!(h.interior(0x10100, 0x1000), None);
        h.mark_decommitted(0x10000, 0x11000, 0x2000);
        h.mark_decommitted(0x10000, 0x14000, 0x1000);
        assert_eq!(h.bytes(), 0x3000);
        assert_eq!(h.missing_runs(0x10000, 0x10800, 0x5000), vec![(0x11000, 0x2000), (0x14000, 0x1000)]);
        assert_eq!(h.missing_runs(0x10000, 0x13000, 0x1000), vec![]);
        assert_eq!(h.committed_runs(0x10000, 0x10000, 0x16000), vec![(0x10000, 0x1000), (0x13000, 0x1000), (0x15000, 0x1000)]);
        h.mark_committed(0x10000, 0x11000, 0x1000);
        assert_eq!(h.bytes(), 0x2000);
        assert_eq!(h.remove_segment(0x10000), 0x2000);
        assert!(h.is_empty());
    }
}
