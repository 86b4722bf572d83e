//! Giving memory back: releasing wholly free segments (reclaim, limits, out-of-memory
//! escalation, cache decay), decommitting the pages inside free blocks on page-mapped
//! upstreams, and recommitting them before a block that covers them is handed out.

use super::Pool;
use crate::block::{Block, Segment};
use crate::error::Result;
use crate::stream::{StreamHandle, StreamKey};
use crate::strategy::ReleaseOrder;
use crate::trace::Action;
use crate::upstream::AllocError;

impl Pool {
    /// About to reserve `grow` more bytes because no cached block fits: first give back
    /// cached segments beyond what the recent peak needs (`decay.rs`); they could not serve
    /// this request anyway. `key`/`stream`: the requester's stream.
    pub(super) fn decay_before_grow(&mut self, grow: usize, key: StreamKey, stream: StreamHandle) {
        if let Some(cap) = self.limits.decay_cap(self.rec.c.used + self.core.strategy().held_beyond_blocks(), grow) {
            if self.rec.c.reserved > cap {
                // A trim waits for the streams whose free memory it gives back: this one's
                // frees, left for its next batched record, would cost a device-wide wait.
                self.cover_own_frees(key, stream);
            }
            self.shrink_to(cap);
        }
    }

    /// Bring reserved memory down towards `cap`: wholly free segments first, then the pages
    /// inside free blocks (page-mapped upstreams). Best effort: what cannot be released
    /// (a failed driver call) simply stays cached.
    pub(super) fn shrink_to(&mut self, cap: usize) {
        let strategy = self.core.strategy();
        if self.rec.c.reserved <= cap || strategy.cached_bytes() - strategy.held_beyond_blocks() == self.core.holes().bytes() {
            return;
        }
        let _ = self.release_in_order(Some(self.rec.c.reserved - cap), ReleaseOrder::OldestFirst);
        if self.rec.c.reserved > cap {
            let got = self.decommit_free(self.rec.c.reserved - cap);
            self.rec.c.reclaimed_bytes += got as u64;
        }
    }

    /// Decommit the pages inside free blocks, longest idle first, until `want` bytes went
    /// back. Each block's stream is synchronised first: no queued kernel may touch a page
    /// that is unmapped. Returns the bytes decommitted.
    pub(super) fn decommit_free(&mut self, want: usize) -> usize {
        if !self.core.holes().supported() {
            return 0;
        }
        let blocks = self.core.strategy_mut().decommit_candidates();
        let mut synced: Vec<StreamKey> = Vec::new();
        let mut got = 0;
        for b in blocks {
            if got >= want {
                break;
            }
            let Some((start, end)) = self.core.holes().interior(b.addr, b.size) else { continue };
            let runs = self.core.holes().committed_runs(b.segment, start, end);
            if runs.is_empty() {
                continue;
            }
            if !synced.contains(&b.stream) {
                let allowed = self.device_sync_allowed();
                if self.core.synchronize_stream(b.stream, allowed).is_err() {
                    continue;
                }
                synced.push(b.stream);
            }
            for (s, l) in runs {
                // A failure says how many pages from `s` went back all the same: exactly
                // those are booked decommitted, the rest stay backed.
                let l = self.core.decommit(b.segment, s, l);
                if l > 0 {
                    self.sub_reserved(l);
                    self.rec.c.decommits += 1;
                    self.trace(0, Action::PageDecommit, s, l);
                    got += l;
                }
            }
        }
        got
    }

    /// Recommit the decommitted pages under a block about to be handed out. Out of memory
    /// releases the rest of the cache once and retries; a failure leaves the block free.
    pub(super) fn commit_block(&mut self, block: &Block) -> Result<()> {
        for (s, l) in self.core.holes().missing_runs(block.segment, block.addr, block.size) {
            let mut retried = false;
            loop {
                let (res, over_limit) = match self.within_budget(l, |up| up.commit(s, l)) {
                    Some(res) => (res, false),
                    None => (Err(AllocError::OutOfMemory), true),
                };
                match res {
                    Ok(()) => {
                        self.core.book_committed(block.segment, s, l);
                        self.add_reserved(l);
                        self.rec.c.commits += 1;
                        self.rec.c.commit_bytes += l as u64;
                        self.trace(0, Action::PageCommit, s, l);
                        break;
                    }
                    Err(AllocError::OutOfMemory) if !retried => {
                        retried = true;
                        self.finish_pending(true);
                        let _ = self.release_cached(None);
                        let _ = self.decommit_free(usize::MAX);
                    }
                    Err(AllocError::OutOfMemory) => return Err(self.oom(block.size, block.size, over_limit)),
                    Err(AllocError::Other(e)) => return Err(e),
                }
            }
        }
        Ok(())
    }

    /// Another shard of this device is out of memory (`crate::registry`): give back every
    /// cached segment (and decommittable page) this pool can, as the last stage of its own
    /// escalation would. Returns the bytes that went back. Not a reclaim the user asked
    /// for, so `n_reclaims` does not count it; the bytes count as reclaimed.
    pub(crate) fn release_for_pressure(&mut self) -> usize {
        if self.running().is_err() {
            return 0;
        }
        let before = self.rec.c.reserved;
        self.flush_thread_caches(None);
        self.finish_pending(true);
        self.fence_unfenced();
        let _ = self.release_cached(None);
        let pages = self.decommit_free(usize::MAX);
        self.rec.c.reclaimed_bytes += pages as u64;
        self.verify();
        before - self.rec.c.reserved
    }

    /// Give wholly free cached segments back to the upstream. Returns the bytes released.
    pub(super) fn release_cached(&mut self, want: Option<usize>) -> Result<usize> {
        self.release_in_order(want, ReleaseOrder::LargestFirst)
    }

    fn release_in_order(&mut self, want: Option<usize>, order: ReleaseOrder) -> Result<usize> {
        if self.core.is_arena() {
            // Whole free granules rather than segments; a failed unmap keeps its granule.
            let released = self.arena_release(want, order);
            self.rec.c.reclaimed_bytes += released as u64;
            return Ok(released);
        }
        // Segments refused earlier are retried first; one refused again stays for later.
        // Free memory of a stream no event covers could only be proven idle by a device-wide
        // wait; while none may be made (a capture may run) its segments stay cached, where
        // that stream can still use them.
        let allowed = self.device_sync_allowed();
        let segs = self.core.releasable_segments(want, order, allowed);
        let mut released = 0;
        let mut first_err = None;
        for seg in segs {
            match self.release_segment(seg) {
                Ok(n) => released += n,
                Err(e) => {
                    first_err.get_or_insert(e);
                    self.core.keep_unreleased(seg);
                }
            }
        }
        self.rec.c.reclaimed_bytes += released as u64;
        match first_err {
            Some(e) => Err(e),
            None => Ok(released),
        }
    }

    /// Returns the bytes of memory (committed pages) that went back.
    pub(super) fn release_segment(&mut self, seg: Segment) -> Result<usize> {
        if self.core.upstream().stream_ordered() && seg.stream == StreamKey::LEGACY {
            // cuMemFreeAsync on the legacy stream orders the release after its work.
            return self.give_to_upstream(seg, crate::stream::STREAM_LEGACY);
        }
        // Work queued on the segment's stream may still touch it. For a stream-ordered
        // upstream the release could be queued on that stream instead, but the stream may
        // since have been destroyed, or be another thread's per-thread stream: wait for its
        // event (for a stream no event covers, for the whole device) and release on the
        // legacy stream.
        let allowed = self.device_sync_allowed();
        if seg.stream == StreamKey::MIXED {
            self.core.synchronize_all_streams(allowed)?;
        } else {
            self.core.synchronize_stream(seg.stream, allowed)?;
        }
        let seg = Segment { stream: StreamKey::LEGACY, ..seg };
        self.give_to_upstream(seg, crate::stream::STREAM_LEGACY)
    }

    /// Hand a segment back to the upstream, ordered on `h`: the legacy stream, or the
    /// stream of the free in progress (never a stored handle, which may be dead).
    /// Returns the bytes of memory (committed pages) that went back.
    pub(super) fn give_to_upstream(&mut self, seg: Segment, h: StreamHandle) -> Result<usize> {
        let committed = self.core.deallocate(seg, h)?;
        self.trace(h, Action::UpstreamFree, seg.base, seg.size);
        self.sub_reserved(committed);
        self.rec.c.upstream_frees += 1;
        Ok(committed)
    }
}
