//! `Core`'s books besides the strategy's: blocks handed out (the live map), frees not yet
//! reusable (deferred by `record_stream`, unfenced), segments the upstream would not take
//! back, and pages decommitted inside cached blocks.

use super::{Core, Live, Pending};
use crate::block::{Block, Segment};
use crate::error::Result;
use crate::pages::Holes;
use crate::strategy::ReleaseOrder;
use crate::stream::{StreamHandle, StreamKey};
use crate::upstream::EventHandle;

/// The live map: blocks handed out, by address.
impl Core {
    #[inline]
    pub fn live(&self, ptr: usize) -> Option<&Live> {
        self.live.get(&ptr)
    }

    /// For its owner and its `record_stream` streams: its block, whose address keys the
    /// map, must not change.
    #[inline]
    pub fn live_mut(&mut self, ptr: usize) -> Option<&mut Live> {
        self.live.get_mut(&ptr)
    }

    #[inline]
    pub fn is_live(&self, ptr: usize) -> bool {
        self.live.contains_key(&ptr)
    }

    /// Book `live` as handed out at its block's address.
    #[inline]
    pub fn insert_live(&mut self, live: Live) {
        self.live.insert(live.block.addr, live);
    }

    /// Take `ptr` out of the live map (a free).
    #[inline]
    pub fn remove_live(&mut self, ptr: usize) -> Option<Live> {
        self.live.remove(&ptr)
    }

    pub fn live_blocks(&self) -> impl Iterator<Item = &Live> {
        self.live.values()
    }

    #[inline]
    pub fn live_count(&self) -> usize {
        self.live.len()
    }
}

/// Frees not yet reusable: deferred by `record_stream`, or waiting for a legacy-stream
/// fence; and segments the upstream would not take back.
impl Core {
    /// Hold `block` until every one of `events` has passed.
    pub fn defer(&mut self, block: Block, events: Vec<EventHandle>) {
        self.pending.push(Pending { block, events });
    }

    #[inline]
    pub fn has_deferred(&self) -> bool {
        !self.pending.is_empty()
    }

    pub fn deferred_blocks(&self) -> impl Iterator<Item = &Block> {
        self.pending.iter().map(|p| &p.block)
    }

    /// The next deferred block whose events passed (all of them waited for, if `wait`),
    /// out of the books with its events recycled; `from` is the scan's position, 0 at the
    /// start. None when no other passed.
    pub fn next_passed(&mut self, wait: bool, from: &mut usize) -> Option<Block> {
        while *from < self.pending.len() {
            let up = &mut *self.upstream;
            let done = self.pending[*from].events.iter().all(|&ev| if wait { up.event_synchronize(ev).is_ok() } else { up.event_query(ev).unwrap_or(false) });
            if done {
                let p = self.pending.swap_remove(*from);
                for ev in p.events {
                    self.streams.recycle(ev);
                }
                return Some(p.block);
            }
            *from += 1;
        }
        None
    }

    #[inline]
    pub fn has_unfenced(&self) -> bool {
        !self.unfenced.is_empty()
    }

    pub fn unfenced_blocks(&self) -> impl Iterator<Item = &Block> {
        self.unfenced.iter()
    }

    /// The bytes of the unfenced frees, as booked (`check` compares them with the blocks).
    #[inline]
    pub fn unfenced_bytes(&self) -> usize {
        self.unfenced_bytes
    }

    /// Keep `seg`, which the upstream would not take back, for a later retry.
    pub fn keep_unreleased(&mut self, seg: Segment) {
        self.unreleased.push(seg);
    }

    pub fn unreleased_bytes(&self) -> usize {
        self.unreleased.iter().map(|s| s.size).sum()
    }

    /// The segments a release may give back now: those refused before (retried first) and
    /// then the strategy's wholly free ones (`want` bytes of them, in `order`; all if
    /// None). Those of a stream whose work cannot be proven done without a device-wide wait
    /// where none may be made (`device_wait` false) stay where they are: refused ones in
    /// the core, free ones in the strategy.
    pub fn releasable_segments(&mut self, want: Option<usize>, order: ReleaseOrder, device_wait: bool) -> Vec<Segment> {
        let mut segs = Vec::new();
        let mut releasable = self.streams.release_gate(device_wait);
        let waiting_for_mixed = !device_wait && self.streams.has_uncovered();
        for seg in std::mem::take(&mut self.unreleased) {
            if (seg.stream == StreamKey::MIXED && waiting_for_mixed) || !releasable(seg.stream) {
                self.unreleased.push(seg);
            } else {
                segs.push(seg);
            }
        }
        segs.extend(self.strategy.drain_free_segments(want, order, &mut releasable));
        segs
    }
}

/// Pages decommitted inside cached blocks (page-mapped upstreams).
impl Core {
    #[inline]
    pub fn holes(&self) -> &Holes {
        &self.holes
    }

    /// Decommit `[start, start + len)` inside cached `segment`'s free block (its stream's
    /// work done). Returns the bytes that went back: on a driver failure, those it says it
    /// unmapped all the same; exactly those are booked as holes.
    pub fn decommit(&mut self, segment: usize, start: usize, len: usize) -> usize {
        let len = self.upstream.decommit(start, len).map_or_else(|f| f.unmapped, |()| len);
        if len > 0 {
            self.holes.mark_decommitted(segment, start, len);
        }
        len
    }

    /// Book `[start, start + len)` of `segment` committed again (the caller committed it,
    /// through the pool's budget).
    pub fn book_committed(&mut self, segment: usize, start: usize, len: usize) {
        self.holes.mark_committed(segment, start, len);
    }

    /// Give `seg` back to the upstream, ordered on `stream`, out of the address index
    /// first (once released, the address may be given to another device's pool) and back
    /// in it if the upstream refuses. Returns the bytes of memory that went back: the
    /// segment less its decommitted pages.
    pub fn deallocate(&mut self, seg: Segment, stream: StreamHandle) -> Result<usize> {
        self.unindex_range(seg.base);
        if let Err(e) = self.upstream.deallocate(seg.base, seg.size, stream) {
            self.index_range(seg.base, seg.size);
            return Err(e);
        }
        Ok(seg.size - self.holes.remove_segment(seg.base))
    }

    /// Give a private pool's segment back (every use of it finished): `deallocate`, or for a
    /// mapped one (`graph_pools::private_segment`) its allocation unmapped and its address
    /// range freed.
    pub fn deallocate_private(&mut self, seg: Segment, mapped: bool) -> Result<usize> {
        if !mapped {
            return self.deallocate(seg, crate::stream::STREAM_LEGACY);
        }
        self.unindex_range(seg.base);
        if let Err(f) = self.upstream.vmm_unmap(seg.base, seg.size) {
            if f.unmapped < seg.size {
                if f.unmapped == 0 {
                    self.index_range(seg.base, seg.size);
                }
                return Err(f.error);
            }
            // Unmapped, its physical memory not released (leaked, as the failure says):
            // the range goes all the same.
            crate::error::warn(&format!("{}", f.error));
        }
        // The range is unmapped: a refused free of it costs address space only.
        let _ = self.upstream.vmm_unreserve(seg.base, seg.size);
        Ok(seg.size - self.holes.remove_segment(seg.base))
    }
}
