//! `none`: no caching. Every request is its own upstream allocation and every free goes
//! straight back (with the `async` upstream this is CuPy's `MemoryAsyncPool`).

use super::{ReleaseOrder, Strategy};
use crate::block::{round_up, Block, Segment, MIN_ALIGN};
use crate::upstream::stream_id::StreamKey;

#[derive(Default)]
pub struct NoneStrategy;

impl NoneStrategy {
    pub fn new() -> Self {
        NoneStrategy
    }
}

impl Strategy for NoneStrategy {
    fn name(&self) -> &'static str {
        "none"
    }
    fn round(&self, size: usize) -> Option<usize> {
        round_up(size, MIN_ALIGN).filter(|&s| s <= isize::MAX as usize)
    }
    fn segment_size(&self, rounded: usize) -> Option<usize> {
        Some(rounded)
    }
    fn take(&mut self, _: usize, _: StreamKey, _: &mut dyn FnMut(StreamKey, usize, usize) -> bool) -> Option<Block> {
        None
    }
    fn add_segment(&mut self, seg: Segment, _rounded: usize) -> Block {
        Block { addr: seg.base, size: seg.size, segment: seg.base, stream: seg.stream, handle: 0 }
    }
    fn put(&mut self, b: Block) -> Option<Segment> {
        Some(Segment { base: b.addr, size: b.size, stream: b.stream })
    }
    fn drain_free_segments(&mut self, _: Option<usize>, _: ReleaseOrder, _: &mut dyn FnMut(StreamKey) -> bool) -> Vec<Segment> {
        Vec::new()
    }
    fn cached_bytes(&self) -> usize {
        0
    }
    fn free_block_count(&self) -> usize {
        0
    }
    fn largest_free_block(&self) -> usize {
        0
    }
    fn free_blocks(&self) -> Vec<Block> {
        Vec::new()
    }
    fn is_free_block(&self, _: usize) -> bool {
        false
    }
    fn check_invariants(&self) -> Result<(), String> {
        Ok(())
    }
}
