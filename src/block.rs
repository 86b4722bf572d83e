//! Blocks and segments: the units the strategies hand around, and the rules for
//! splitting and merging them.
//!
//! A *segment* is one upstream allocation; a *block* is a piece of a segment. Metadata lives
//! here on the host, never in the (device) memory it describes.

use crate::upstream::stream_id::StreamKey;

/// Every address handed out is a multiple of this (the upstream contract's alignment).
pub use crate::upstream::MIN_ALIGN;

/// One upstream allocation.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    pub base: usize,
    pub size: usize,
    /// Stream the segment was last used on; releasing it is ordered on this stream.
    pub stream: StreamKey,
}

/// A contiguous piece of one segment, allocated or free.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Block {
    pub addr: usize,
    pub size: usize,
    /// Base address of the segment this block lives in.
    pub segment: usize,
    /// Stream whose work last touched this block (its free stream while cached).
    pub stream: StreamKey,
    /// The strategy's own name for the block (`split`: its node's slot), so a free finds
    /// the bookkeeping without an address lookup; 0 for strategies that need none.
    pub handle: u32,
}

impl Block {
    pub fn end(&self) -> usize {
        self.addr + self.size
    }

    /// Cut `self` into a front of `size` bytes and the rest; both stay in the same
    /// segment and keep the stream tag (the rest was freed on the same stream).
    pub fn split(self, size: usize) -> (Block, Block) {
        debug_assert!(size < self.size && size % MIN_ALIGN == 0);
        let front = Block { size, ..self };
        let rest = Block { addr: self.addr + size, size: self.size - size, ..self };
        (front, rest)
    }

    /// Whether `self` and `next` may become one block: adjacent, in the same upstream
    /// allocation (merging across upstream allocations would hand out memory that the
    /// driver may free in two pieces), and tagged with the same stream.
    pub fn can_merge(&self, next: &Block) -> bool {
        self.end() == next.addr && self.segment == next.segment && self.stream == next.stream
    }
}

/// Round `size` up to a multiple of `to` (a power of two); `None` on overflow.
pub fn round_up(size: usize, to: usize) -> Option<usize> {
    debug_assert!(to.is_power_of_two());
    size.checked_add(to - 1).map(|s| s & !(to - 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_and_merge_rules() {
        let b = Block { addr: 4096, size: 4096, segment: 4096, stream: StreamKey::LEGACY, handle: 0 };
        let (a, r) = b.split(1024);
        assert_eq!((a.addr, a.size, r.addr, r.size), (4096, 1024, 5120, 3072));
        assert!(a.can_merge(&r));
        assert!(!r.can_merge(&a));
        let other_seg = Block { segment: 5120, ..r };
        assert!(!a.can_merge(&other_seg));
        let other_stream = Block { stream: StreamKey(7), ..r };
        assert!(!a.can_merge(&other_stream));
    }

    #[test]
    fn rounding_never_overflows() {
        assert_eq!(round_up(1, 512), Some(512));
        assert_eq!(round_up(512, 512), Some(512));
        assert_eq!(round_up(usize::MAX, 512), None);
        assert_eq!(round_up(usize::MAX - 510, 512), None);
    }
}
