//! The pool's side of the `arena` strategy: reserving its address space, the driver calls
//! that back a planned window (moving free granules there, mapping new ones for the rest),
//! and giving whole free granules back under pressure.
//!
//! The strategy plans and keeps the books; every driver call is made here, and the books
//! are updated after each call that succeeded, so a failure midway leaves them exact.

use super::Pool;
use crate::error::{Error, Result};
use crate::strategy::arena::{ArenaStrategy, Growth};
use crate::strategy::{ReleaseOrder, Strategy};
use crate::stream::{StreamHandle, StreamKey};
use crate::trace::Action;
use crate::upstream::{AllocError, Upstream};

/// Why a growth failed.
pub(super) enum GrowFail {
    /// Not enough memory (device or limit): release or flush, then retry.
    OutOfMemory { by_limit: bool },
    Other(Error),
}

/// Build the arena over address space reserved from `up`, or say why not (the caller falls
/// back to `split` and shows the reason in the status report).
pub(super) fn build(up: &mut dyn Upstream, va_bytes: Option<usize>) -> std::result::Result<Box<dyn Strategy>, String> {
    let g = up.vmm_granule();
    if g == 0 {
        return Err(format!("arena unavailable: the {} upstream or its device has no virtual memory management; using split", up.name()));
    }
    let total = up.mem_info().map(|m| m.1).unwrap_or(0).max(g);
    let round = |n: usize| n.div_ceil(g) * g;
    // Large tensors get twice the device's memory of address space: room for holes left by
    // moved granules. Small blocks get one device's worth.
    let mut large = round(va_bytes.unwrap_or(total.saturating_mul(2)));
    let small = round(total.min(large));
    let small_base = up.vmm_reserve(small).map_err(|e| format!("arena unavailable: reserving address space failed ({e}); using split"))?;
    loop {
        match up.vmm_reserve(large) {
            Ok(base) => return Ok(Box::new(ArenaStrategy::new((small_base, small), (base, large), g))),
            Err(e) if large <= total / 2 || va_bytes.is_some() => {
                let _ = up.vmm_unreserve(small_base, small);
                return Err(format!("arena unavailable: reserving {large} bytes of address space failed ({e}); using split"));
            }
            Err(_) => large = round(large / 2),
        }
    }
}

impl Pool {
    fn arena(&mut self) -> &mut ArenaStrategy {
        self.strategy.as_arena().expect("called for arena pools only")
    }

    /// Serve `rounded` bytes by mapping a window (`Pool::grow` for the arena), escalating as
    /// the segment pools do: as is, after flushing thread caches and CuPy frees, after
    /// waiting for deferred frees.
    pub(super) fn grow_arena(&mut self, size: usize, rounded: usize, key: StreamKey, stream: StreamHandle, retake: bool) -> Result<crate::block::Block> {
        let mut by_limit = false;
        for stage in 0..3 {
            if stage > 0 {
                self.flush_thread_caches();
                self.fence_unfenced();
                if stage == 2 {
                    self.finish_pending(true);
                }
                self.strategy.flush_deferred();
                if retake {
                    if let Some(b) = self.take_cached(rounded, key, stream) {
                        return Ok(b);
                    }
                }
            }
            let plan = {
                let (streams, up) = (&mut self.streams, &mut *self.upstream);
                let mut gate = |from: StreamKey| streams.make_safe(up, from, key, stream);
                self.strategy.as_arena_ref().expect("arena pool").plan(rounded, key, &mut gate)
            };
            let Some(growth) = plan else { continue };
            if stage == 0 {
                let new = growth.window.targets.len().saturating_sub(growth.donors.len()) * self.arena().granule();
                self.decay_before_grow(new);
            }
            match self.back_window(&growth, key, stream) {
                Ok(()) => return Ok(self.arena().carve(&growth, key)),
                Err(GrowFail::OutOfMemory { by_limit: l }) => by_limit = l,
                Err(GrowFail::Other(e)) => return Err(e),
            }
        }
        Err(self.oom(size, rounded, by_limit))
    }

    /// Map every target granule of `growth`'s window: donors moved first (their streams
    /// synchronised: no queued kernel may touch memory that moves), new memory for the rest.
    fn back_window(&mut self, growth: &Growth, key: StreamKey, stream: StreamHandle) -> std::result::Result<(), GrowFail> {
        let g = self.arena().granule();
        let mut synced: Vec<StreamKey> = Vec::new();
        let mut failed: Vec<StreamKey> = Vec::new();
        let mut donors = growth.donors.iter();
        let mut rest = Vec::new();
        for &t in &growth.window.targets {
            let mut placed = false;
            for d in donors.by_ref() {
                if !self.sync_all(&d.streams, &mut synced, &mut failed) {
                    continue;
                }
                if self.upstream.vmm_move(d.addr, t).is_ok() {
                    self.arena().moved(d.space, d.addr, growth.space, t, key);
                    self.trace(stream, Action::GranuleMove, t, g);
                    placed = true;
                    break;
                }
            }
            if !placed {
                rest.push(t);
            }
        }
        // New memory, one call per run of adjacent granules.
        let mut i = 0;
        while i < rest.len() {
            let mut j = i + 1;
            while j < rest.len() && rest[j] == rest[j - 1] + g {
                j += 1;
            }
            let (addr, len) = (rest[i], (j - i) * g);
            if self.over_limit(len) {
                return Err(GrowFail::OutOfMemory { by_limit: true });
            }
            match self.upstream.vmm_map_new(addr, len) {
                Ok(()) => {
                    self.arena().mapped(addr, len, key);
                    self.c.reserved += len;
                    self.c.peak_reserved = self.c.peak_reserved.max(self.c.reserved);
                    self.c.upstream_allocs += 1;
                    self.c.upstream_alloc_bytes += len as u64;
                    self.trace(stream, Action::UpstreamAlloc, addr, len);
                }
                Err(AllocError::OutOfMemory) => return Err(GrowFail::OutOfMemory { by_limit: false }),
                Err(AllocError::Other(e)) => return Err(GrowFail::Other(e)),
            }
            i = j;
        }
        Ok(())
    }

    /// Give back whole free granules in `order` until `want` bytes went (`None`: all).
    /// Each run's stream is synchronised first. Returns the bytes released.
    pub(super) fn arena_release(&mut self, want: Option<usize>, order: ReleaseOrder) -> usize {
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
            if self.upstream.vmm_unmap(addr, len).is_ok() {
                self.arena().unmapped(addr, len);
                self.c.reserved -= len;
                self.c.upstream_frees += 1;
                self.trace(0, Action::UpstreamFree, addr, len);
                got += len;
            }
        }
        got
    }

    /// Wait until every free on `streams` has completed (each stream once per operation:
    /// `synced` and `failed` remember). False when one cannot be waited for: its memory
    /// must not move or go back.
    fn sync_all(&mut self, streams: &[StreamKey], synced: &mut Vec<StreamKey>, failed: &mut Vec<StreamKey>) -> bool {
        for &s in streams {
            if failed.contains(&s) {
                return false;
            }
            if !synced.contains(&s) {
                if self.streams.synchronize(&mut *self.upstream, s).is_err() {
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
        let Some(a) = self.strategy.as_arena_ref() else { return };
        if a.mapped_bytes() != 0 {
            return; // live blocks keep their memory and addresses until the process ends
        }
        for (base, len) in a.reservations() {
            let _ = self.upstream.vmm_unreserve(base, len);
        }
    }

    /// The arena's lines of the reports: `(json fields, status text)`; empty for other pools.
    pub(super) fn arena_report(&self) -> Option<(String, String)> {
        let a = self.strategy.as_arena_ref()?;
        let c = a.counters;
        let g = a.granule();
        let mapped = a.mapped_bytes();
        let json = format!(
            concat!(
                "{{\"granule\":{},\"mapped_bytes\":{},\"reserved_address_space\":{},\"granules_mapped\":{},",
                "\"granules_unmapped\":{},\"granules_moved\":{},\"stitches\":{}}}"
            ),
            g,
            mapped,
            a.reserved_address_space(),
            c.granules_mapped,
            c.granules_unmapped,
            c.granules_moved,
            c.stitches
        );
        let h = crate::error::human_bytes;
        let text = format!(
            "  Arena: {} mapped in {} granules of {}, {} of address space; granules mapped {}, unmapped {}, moved {} ({} stitches)",
            h(mapped),
            mapped / g,
            h(g),
            h(a.reserved_address_space()),
            c.granules_mapped,
            c.granules_unmapped,
            c.granules_moved,
            c.stitches
        );
        Some((json, text))
    }
}
