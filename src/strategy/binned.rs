//! `binned`: power-of-two bins (CUDA.jl's `binned` pool). A request is rounded up to the
//! next power of two (at least 512 B) and served by a whole cached block of exactly that
//! size, or by a new upstream allocation of that size. No splitting, no coalescing: fast
//! and predictable, at the price of up to 2x internal waste.

use super::{ReleaseOrder, Strategy};
use crate::block::{Block, Segment};
use crate::upstream::stream_id::StreamKey;
use rustc_hash::FxHashMap;

const MIN_BIN: usize = 512;

#[derive(Default)]
pub struct BinnedStrategy {
    /// Free blocks by bin size. Every block is a whole segment.
    bins: FxHashMap<usize, Vec<Block>>,
    cached: usize,
    count: usize,
}

impl BinnedStrategy {
    pub fn new() -> Self {
        Self::default()
    }
}

impl Strategy for BinnedStrategy {
    fn name(&self) -> &'static str {
        "binned"
    }

    fn round(&self, size: usize) -> Option<usize> {
        size.max(MIN_BIN).checked_next_power_of_two().filter(|&s| s <= isize::MAX as usize)
    }

    fn segment_size(&self, rounded: usize) -> Option<usize> {
        Some(rounded)
    }

    fn take(&mut self, rounded: usize, stream: StreamKey, reusable: &mut dyn FnMut(StreamKey, usize, usize) -> bool) -> Option<Block> {
        let bin = self.bins.get_mut(&rounded)?;
        // Most recently freed first (warm in cache, likely same stream), same stream first.
        let pos = bin.iter().rposition(|b| b.stream == stream).or_else(|| {
            // A stream that refuses one block is not asked again in this call (each asking
            // may make the requester wait on it).
            let mut tried: Vec<StreamKey> = Vec::new();
            for i in (0..bin.len()).rev() {
                let s = bin[i].stream;
                if tried.contains(&s) {
                    continue;
                }
                if reusable(s, bin[i].addr, bin[i].size) {
                    return Some(i);
                }
                tried.push(s);
            }
            None
        })?;
        let mut b = bin.swap_remove(pos);
        b.stream = stream;
        self.cached -= b.size;
        self.count -= 1;
        Some(b)
    }

    fn add_segment(&mut self, seg: Segment, _rounded: usize) -> Block {
        Block { addr: seg.base, size: seg.size, segment: seg.base, stream: seg.stream, handle: 0 }
    }

    fn put(&mut self, b: Block) -> Option<Segment> {
        self.cached += b.size;
        self.count += 1;
        self.bins.entry(b.size).or_default().push(b);
        None
    }

    fn drain_free_segments(&mut self, want: Option<usize>, _order: ReleaseOrder, releasable: &mut dyn FnMut(StreamKey) -> bool) -> Vec<Segment> {
        let mut sizes: Vec<usize> = self.bins.keys().copied().collect();
        sizes.sort_unstable_by(|a, b| b.cmp(a));
        let mut out = Vec::new();
        let mut got = 0;
        'outer: for s in sizes {
            let bin = self.bins.get_mut(&s).expect("key just listed");
            let mut i = bin.len();
            while i > 0 {
                i -= 1;
                if !releasable(bin[i].stream) {
                    continue;
                }
                let b = bin.swap_remove(i);
                got += b.size;
                self.cached -= b.size;
                self.count -= 1;
                out.push(Segment { base: b.addr, size: b.size, stream: b.stream });
                if want.is_some_and(|w| got >= w) {
                    break 'outer;
                }
            }
        }
        self.bins.retain(|_, v| !v.is_empty());
        out
    }

    fn cached_bytes(&self) -> usize {
        self.cached
    }
    fn free_block_count(&self) -> usize {
        self.count
    }
    fn largest_free_block(&self) -> usize {
        self.bins.iter().filter(|(_, v)| !v.is_empty()).map(|(s, _)| *s).max().unwrap_or(0)
    }
    fn free_blocks(&self) -> Vec<Block> {
        self.bins.values().flatten().copied().collect()
    }
    fn is_free_block(&self, addr: usize) -> bool {
        self.bins.values().flatten().any(|b| b.addr == addr)
    }

    fn check_invariants(&self) -> Result<(), String> {
        let mut cached = 0;
        let mut count = 0;
        for (size, v) in &self.bins {
            if !size.is_power_of_two() {
                return Err(format!("bin {size} is not a power of two"));
            }
            for b in v {
                if b.size != *size || b.segment != b.addr {
                    return Err(format!("block {b:?} misfiled in bin {size}"));
                }
                cached += b.size;
                count += 1;
            }
        }
        if cached != self.cached || count != self.count {
            return Err(format!("binned totals drifted: {cached}/{count} vs {}/{}", self.cached, self.count));
        }
        Ok(())
    }
}
