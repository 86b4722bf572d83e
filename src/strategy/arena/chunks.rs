//! Chunks: physical allocations of several granules in the large range.
//!
//! A growth of many granules at once (a large tensor's first peak) is mapped as a few
//! chunks instead of one allocation per granule: one create + map each, not one per
//! granule. A stitch then aliases a chunk with one `cuMemMap`, so a stitch of a 2 GiB
//! tensor costs tens of calls, not a thousand. The driver maps, unmaps and exports an
//! allocation only whole (`cuMemMap` at an offset into a handle is refused), so a chunk is
//! stitched, released and exported only whole, and never lent (loans alias single
//! granules). Small growths stay one granule per allocation: whole-chunk stitching cannot
//! use the free granules of a chunk that is partly in use, so coarse chunks where blocks
//! are small would cost memory.
//!
//! The policy: a run of at least `from` bytes (`PoolOptions::arena_chunk_from`, `CHUNK_FROM`
//! by default) is cut into equal chunks (granule multiples) of at most half the run and at
//! most `max` bytes (`PoolOptions::arena_chunk`; the pool cuts them, `Pool::map_granules`);
//! shorter runs, and every run when `max` is a granule or less, map granule by granule.
//! A lower `from` is the other side of the same trade: fewer allocations (fewer driver
//! calls at growth and stitching, fewer imports where the blocks are shared) for memory
//! stranded in chunks partly in use where block sizes are mixed (`0` chunks every growth
//! of four granules or more, whose halves are two granules). The pool also maps granules
//! once the device's reserved memory would pass half of what it may hold, where stranded
//! memory would cost.

use super::space::FreeRun;
use super::{ArenaStrategy, LARGE};
use crate::upstream::stream_id::StreamKey;
use std::collections::BTreeMap;

/// Growth runs at least this long are mapped as chunks by default (`GPUPOOL_ARENA_CHUNK_FROM`).
pub const CHUNK_FROM: usize = crate::config::ARENA_CHUNK_FROM;
/// The largest chunk by default (`GPUPOOL_ARENA_CHUNK`).
pub const CHUNK_MAX: usize = crate::config::ARENA_CHUNK;

pub struct Chunks {
    /// Chunk base -> bytes (several granules; a granule not in here is its own allocation).
    map: BTreeMap<usize, usize>,
    granule: usize,
    max: usize,
    /// The shortest growth run mapped as chunks.
    from: usize,
    /// The device's memory (for the pool's rule on when chunks are made).
    device_bytes: usize,
}

impl Chunks {
    pub fn new(granule: usize) -> Chunks {
        Chunks { map: BTreeMap::new(), granule, max: CHUNK_MAX, from: CHUNK_FROM, device_bytes: usize::MAX }
    }

    /// The largest chunk (`0` or a granule: none).
    pub fn set_max(&mut self, max: usize) {
        self.max = max;
    }

    /// The shortest growth run mapped as chunks.
    pub fn set_from(&mut self, from: usize) {
        self.from = from;
    }

    /// Bytes per allocation for a growth run of `run` bytes (a granule: one per granule).
    pub fn size_for(&self, run: usize) -> usize {
        let g = self.granule;
        if run < self.from || self.max <= g {
            return g;
        }
        (run / 2 / g * g).clamp(g, self.max / g * g)
    }

    pub fn add(&mut self, base: usize, len: usize) {
        if len > self.granule {
            self.map.insert(base, len);
        }
    }

    pub fn remove(&mut self, base: usize) {
        self.map.remove(&base);
    }

    /// Chunks mapped now, and their bytes (the reports: memory that is stitched, released
    /// and exported only whole).
    pub fn usage(&self) -> (usize, usize) {
        (self.map.len(), self.map.values().sum())
    }

    /// The chunk holding `addr`, if any: (base, bytes).
    pub fn of(&self, addr: usize) -> Option<(usize, usize)> {
        self.map.range(..=addr).next_back().filter(|(&b, &l)| addr < b + l).map(|(&b, &l)| (b, l))
    }

    /// The allocation holding `addr`: its chunk, or its granule.
    pub fn allocation(&self, addr: usize) -> (usize, usize) {
        self.of(addr).unwrap_or((addr & !(self.granule - 1), self.granule))
    }

    /// The parts of `runs` (free granules, address order) made of whole allocations: what
    /// a stitch or a release may take.
    pub fn whole_runs(&self, runs: Vec<FreeRun>) -> Vec<FreeRun> {
        if self.map.is_empty() {
            return runs;
        }
        let mut out = Vec::with_capacity(runs.len());
        for r in runs {
            let end = r.addr + r.len;
            // Cut off a chunk that sticks out at either end.
            let start = match self.of(r.addr) {
                Some((b, l)) if b < r.addr => b + l,
                _ => r.addr,
            };
            let stop = match self.of(end - 1) {
                Some((b, l)) if b + l > end => b,
                _ => end,
            };
            if stop > start {
                out.push(FreeRun { addr: start, len: stop - start, ..r });
            }
        }
        out
    }

    /// `homes` (ascending) with the rest of every chunk they touch, ascending: a stitch
    /// aliases chunks whole. The caller took them from `whole_runs`, so the rest is free.
    pub fn extend(&self, homes: Vec<usize>) -> Vec<usize> {
        if self.map.is_empty() {
            return homes;
        }
        let g = self.granule;
        let mut out: Vec<usize> = Vec::with_capacity(homes.len());
        for h in homes {
            if out.last().is_some_and(|&l| l >= h) {
                continue;
            }
            let (b, l) = self.allocation(h);
            out.extend((b.max(out.last().map_or(0, |&x| x + g))..b + l).step_by(g));
        }
        out
    }

    /// The allocations `homes` shows in order, as (first index, granules): one alias
    /// mapping each. `homes` lists each chunk whole, in order.
    pub fn mappings(&self, homes: &[usize]) -> Vec<(usize, usize)> {
        let g = self.granule;
        let mut out = Vec::new();
        let mut i = 0;
        while i < homes.len() {
            let n = match self.of(homes[i]) {
                Some((b, l)) if b == homes[i] => (l / g).min(homes.len() - i),
                _ => 1,
            };
            out.push((i, n));
            i += n;
        }
        out
    }

    /// `[first, end)` rounded out to whole allocations.
    pub fn round_out(&self, first: usize, end: usize) -> (usize, usize) {
        let lo = self.allocation(first).0;
        let (b, l) = self.allocation(end - 1);
        (lo, b + l)
    }

    pub fn check(&self, mapped: impl Fn(usize) -> bool) -> Result<(), String> {
        let mut at = 0;
        for (&b, &l) in &self.map {
            if b < at || l <= self.granule || l % self.granule != 0 || b % self.granule != 0 {
                return Err(format!("chunk {b:#x}+{l:#x} overlaps or is not granules"));
            }
            if !(b..b + l).step_by(self.granule).all(&mapped) {
                return Err(format!("chunk {b:#x}+{l:#x} is not all mapped"));
            }
            at = b + l;
        }
        Ok(())
    }
}

impl ArenaStrategy {
    /// Chunks mapped now, and their bytes.
    pub fn chunk_usage(&self) -> (usize, usize) {
        self.chunks.usage()
    }

    /// The largest chunk, and the shortest growth mapped as chunks.
    pub fn set_chunks(&mut self, max: usize, from: usize) {
        self.chunks.set_max(max);
        self.chunks.set_from(from);
    }

    /// The device's memory, as the upstream reported it when the arena was built.
    pub fn set_device_bytes(&mut self, bytes: usize) {
        self.chunks.device_bytes = bytes;
    }

    pub fn device_bytes(&self) -> usize {
        self.chunks.device_bytes
    }

    /// Bytes per allocation for new memory under the run `[addr, addr + len)`; a granule
    /// where `chunking` is off (memory is short: a chunk partly in use could be neither
    /// stitched nor released later).
    pub fn chunk_for(&self, addr: usize, len: usize, chunking: bool) -> usize {
        if chunking && self.space_of(addr) == LARGE {
            self.chunks.size_for(len)
        } else {
            self.granule
        }
    }

    /// New memory now backs `[addr, addr + len)` as one allocation.
    pub fn mapped_chunk(&mut self, addr: usize, len: usize, stream: StreamKey) {
        self.mapped(addr, len, stream);
        self.chunks.add(addr, len);
    }

    /// The allocation holding `addr` (a home of the arena's ranges): (base, bytes).
    pub fn allocation_at(&self, addr: usize) -> (usize, usize) {
        self.chunks.allocation(addr)
    }

    /// The allocations `homes` (whole ones, in order) shows, as (first index, granules).
    pub fn mappings_of(&self, homes: &[usize]) -> Vec<(usize, usize)> {
        self.chunks.mappings(homes)
    }

    /// Stitch `id`'s alias mappings, as (offset from its base, bytes), in order: one per
    /// allocation it shows (the driver removes whole mappings only).
    pub fn stitch_mappings(&self, id: u32) -> Vec<(usize, usize)> {
        let g = self.granule;
        self.chunks.mappings(&self.stitches.get(id).homes).into_iter().map(|(i, n)| (i * g, n * g)).collect()
    }

    /// `[ptr, ptr + size)` rounded out to the whole allocations another process must map
    /// to see it (through a stitch: the allocations its aliases show there).
    pub fn export_extent(&self, ptr: usize, size: usize) -> (usize, usize) {
        let g = self.granule;
        let (first, end) = (ptr & !(g - 1), (ptr + size).div_ceil(g) * g);
        if !self.stitches.contains(ptr) {
            return self.chunks.round_out(first, end);
        }
        let Some((id, st)) = self.stitches.iter().find(|(_, s)| ptr >= s.base && ptr < s.base + s.len) else {
            return (first, end);
        };
        let (mut lo, mut hi) = (first, end);
        for (off, len) in self.stitch_mappings(id) {
            let (a, e) = (st.base + off, st.base + off + len);
            if a < end && e > first {
                lo = lo.min(a);
                hi = hi.max(e);
            }
        }
        (lo, hi)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: usize = 2 << 20;

    fn run(addr: usize, len: usize) -> FreeRun {
        FreeRun { addr, len, streams: Vec::new(), freed_at: 0 }
    }

    #[test]
    fn runs_are_cut_to_whole_chunks_and_homes_extended() {
        let mut c = Chunks::new(G);
        assert_eq!(c.size_for(32 * G - G), G, "short runs stay granules");
        assert_eq!(c.size_for(64 * G), 32 * G);
        assert_eq!(c.size_for(1000 * G), 128 * G, "at most the maximum");
        c.add(10 * G, 4 * G); // chunk [10, 14)
        c.add(20 * G, 3 * G); // chunk [20, 23)
        // A run [12, 22) holds half of each chunk: only granules 14..20 are whole.
        assert_eq!(c.whole_runs(vec![run(12 * G, 10 * G)]).iter().map(|r| (r.addr / G, r.len / G)).collect::<Vec<_>>(), vec![(14, 6)]);
        assert_eq!(c.whole_runs(vec![run(10 * G, 4 * G)]).len(), 1, "a whole chunk stays");
        assert!(c.whole_runs(vec![run(11 * G, 2 * G)]).is_empty());
        let homes = c.extend(vec![5 * G, 10 * G, 21 * G]);
        assert_eq!(homes.iter().map(|h| h / G).collect::<Vec<_>>(), vec![5, 10, 11, 12, 13, 20, 21, 22]);
        assert_eq!(c.mappings(&homes), vec![(0, 1), (1, 4), (5, 3)]);
        assert_eq!(c.round_out(11 * G + 5, 12 * G), (10 * G, 14 * G));
        assert_eq!(c.round_out(15 * G, 16 * G), (15 * G, 16 * G));
        assert_eq!(c.size_for(8 * G), G, "under the default threshold");
        c.set_from(4 * G);
        assert_eq!(c.size_for(8 * G), 4 * G, "a lower threshold chunks shorter runs");
        assert_eq!(c.size_for(4 * G), 2 * G, "a run of exactly the threshold is chunked");
        assert_eq!(c.size_for(3 * G), G, "a shorter one is not");
        c.set_max(G);
        assert_eq!(c.size_for(1000 * G), G, "chunks off");
    }
}
