//! Giving the arena's memory back: whole free granules in the order asked, stitches over
//! them first, each run's stream synchronised before its memory goes; and the teardown.

use super::*;

impl Pool {
    /// Give back whole free granules in `order` until `want` bytes went (`None`: all).
    /// Each run's stream is synchronised first. Returns the bytes released.
    pub(in crate::pool) fn arena_release(&mut self, want: Option<usize>, order: ReleaseOrder) -> usize {
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
    pub(in crate::pool) fn arena_teardown(&mut self) {
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
