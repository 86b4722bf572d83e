//! Giving memory back: releasing wholly free segments (reclaim, limits, out-of-memory
//! escalation, cache decay), decommitting the pages inside free blocks on page-mapped
//! upstreams, and recommitting them before a block that covers them is handed out; for the
//! arena, whole free granules (stitches over them first, each run's stream synchronised
//! before its memory goes) and the teardown of its address space.

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

/// The arena's memory back to the driver.
impl Pool {
    /// Give back whole free granules in `order` until `want` bytes went (`None`: all).
    /// Each run's stream is synchronised first. Returns the bytes released.
    fn arena_release(&mut self, want: Option<usize>, order: ReleaseOrder) -> usize {
        if self.paused.is_some() {
            return 0; // its memory is given back already, and its books stay as they are
        }
        let mut got = 0;
        // A pass that ends loans frees their homes, which the next pass can give back.
        loop {
            let (n, loans_ended) = self.arena_release_pass(want.map(|w| w.saturating_sub(got)), order);
            got += n;
            if !loans_ended || want.is_some_and(|w| got >= w) {
                return got;
            }
        }
    }

    fn arena_release_pass(&mut self, want: Option<usize>, order: ReleaseOrder) -> (usize, bool) {
        // Aliases a failed loan left behind: try again to remove them (their granules were
        // never handed out, so no queued work uses them).
        let g = self.arena().granule();
        for at in self.arena().stuck() {
            if self.core.upstream_mut().vmm_unalias(at, g).is_ok() {
                self.arena().unstick(at);
            }
        }
        let mut loans_ended = false;
        let runs = self.arena().releasable(order);
        let (mut synced, mut failed) = (Vec::new(), Vec::new());
        let mut got = 0;
        for run in runs {
            if want.is_some_and(|w| got >= w) {
                break;
            }
            if !self.sync_all(&run.streams, &mut synced, &mut failed) {
                continue;
            }
            let (addr, len) = (run.addr, run.len);
            // Aliases of these granules go first (`releasable` left out those of stitches
            // handed out: the stitches over these are free).
            let over = self.arena().stitches_over(addr, len);
            if over.into_iter().any(|id| self.drop_stitch(id).is_err()) {
                continue;
            }
            // One allocation per call: a failure midway leaves the books exact (the driver
            // unmaps whole allocations anyway).
            // Runs of allocations released side by side are traced (and counted) as one
            // upstream free each, exactly what went back.
            let mut released_from: Option<usize> = None;
            let mut next = addr;
            while next < addr + len {
                let at = next;
                let (_, alloc) = self.arena().allocation_at(at);
                next = at + alloc;
                if self.arena().is_lent(at) {
                    self.trace_released(released_from.take(), at);
                    // Its memory is the other range's granule: remove the alias and give the
                    // home back too (idle: its users' streams were waited for above, and a
                    // home under a loan has no other alias). A home whose unmap fails stays
                    // free in its range for a later pass.
                    if self.core.upstream_mut().vmm_unalias(at, g).is_err() {
                        break;
                    }
                    let home = self.arena().end_loan(at, StreamKey::LEGACY);
                    loans_ended = true;
                    if let Some(n) = self.unmap_allocation(home, g) {
                        got += n;
                        self.rec.c.upstream_frees += 1;
                        self.trace(0, Action::UpstreamFree, home, g);
                    }
                    continue;
                }
                let Some(n) = self.unmap_allocation(at, alloc) else {
                    next = at;
                    break;
                };
                got += n;
                released_from.get_or_insert(at);
            }
            self.trace_released(released_from, next);
        }
        (got, loans_ended)
    }

    /// `[from, to)` went back to the driver: one upstream free, traced.
    fn trace_released(&mut self, from: Option<usize>, to: usize) {
        if let Some(from) = from.filter(|&f| f < to) {
            self.rec.c.upstream_frees += 1;
            self.trace(0, Action::UpstreamFree, from, to - from);
        }
    }

    /// Unmap the free allocation `[at, at + g)` (a granule or a chunk; no alias over it,
    /// its streams waited for) and book exactly what the driver did. `None`: it is still
    /// mapped (and booked so). Otherwise its address is gone and booked unmapped, so no
    /// block is ever carved over it unmapped; returns the bytes released, 0 where the driver
    /// unmapped it but would not release its memory (leaked: counted and reported, never
    /// handed out again).
    fn unmap_allocation(&mut self, at: usize, g: usize) -> Option<usize> {
        let leaked = match self.core.upstream_mut().vmm_unmap(at, g) {
            Ok(()) => None,
            Err(f) if f.unmapped >= g => Some(f.error),
            Err(_) => return None,
        };
        self.arena().unmapped(at, g);
        self.sub_reserved(g);
        let Some(error) = leaked else { return Some(g) };
        self.core.book_arena_leak(g);
        static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
            crate::error::warn(&format!(
                "gpupool: warning: device {}: the driver unmapped a granule of the arena but would not release its memory ({error}); \
                 it is lost until the process ends (the status report counts such memory as leaked; this is said once)",
                self.core.device()
            ));
        }
        Some(0)
    }

    /// Wait until every free on `streams` has completed (each stream once per operation:
    /// `synced` and `failed` remember). False when one cannot be waited for: its memory
    /// must not go back.
    fn sync_all(&mut self, streams: &[StreamKey], synced: &mut Vec<StreamKey>, failed: &mut Vec<StreamKey>) -> bool {
        for &s in streams {
            if failed.contains(&s) {
                return false;
            }
            if !synced.contains(&s) {
                let allowed = self.device_sync_allowed();
                if self.core.synchronize_stream(s, allowed).is_err() {
                    failed.push(s);
                    return false;
                }
                synced.push(s);
            }
        }
        true
    }

    /// Pool teardown: give the address space back when nothing in it is live any more.
    pub(super) fn arena_teardown(&mut self) {
        let Some(a) = self.core.arena() else { return };
        if a.mapped_bytes() != 0 {
            return; // live blocks keep their memory and addresses until the process ends
        }
        for id in a.free_stitches() {
            let _ = self.drop_stitch(id);
        }
        let a = self.arena_ref();
        for (base, len) in a.reservations() {
            if self.core.upstream_mut().vmm_unreserve(base, len).is_ok() {
                self.core.unindex_range(base);
            }
        }
    }
}
