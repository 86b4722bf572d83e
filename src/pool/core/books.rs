//! `Core`'s books besides the strategy's: blocks handed out (the live map), frees not yet
//! reusable (deferred by `record_stream`, unfenced), segments the upstream would not take
//! back, and pages decommitted inside cached blocks.

use super::{Core, Live, Pending};
use crate::block::{Block, Segment};
use crate::pages::Holes;
use crate::strategy::ReleaseOrder;
use crate::stream::StreamKey;
use crate::upstream::EventHandle;

/// The live map: blocks handed out, by address.
impl Core {
    #[inline]
    pub fn live(&self, ptr: usize) -> Option<&Live> {
        self.live.get(&ptr)
    }

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
    /// None), leaving cached those of a stream whose work cannot be proven done without a
    /// device-wide wait where none may be made (`device_wait` false).
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

    #[inline]
    pub fn holes_mut(&mut self) -> &mut Holes {
        &mut self.holes
    }
}
