//! Finding memory for a request: the cache first, then PyTorch's escalation order (flush
//! deferred frees, thread caches' reusable blocks, a device-wide wait where frees no event
//! covers would otherwise make the pool grow, new segments, releasing some cached memory,
//! then all of it) and the out-of-memory report. The escalation is one loop (`escalate`)
//! for every growth path of the main cache: segment pools grow here, the arena through
//! `arena.rs`. These are `Pool` methods because growth meets every layer: the core's cache
//! and upstream, the limits' claims, the thread caches' kept blocks, and the graph-pool
//! layer's word on whether the device may be waited for.

use super::arena::ArenaGrowth;
use super::growth::{Attempt, Grower, Request, Stage};
use super::{Pool, UNRECORDED_WAIT_MIN};
use crate::block::{Block, Segment};
use crate::error::{Error, OomReport, Result};
use crate::stream::{StreamHandle, StreamKey};
use crate::trace::Action;
use crate::upstream::AllocError;

/// Growth of the segment pools: a new segment of the strategy's `preferred` size, else
/// one of just the request.
struct SegmentGrowth {
    preferred: usize,
}

impl Grower for SegmentGrowth {
    fn serve(&self, pool: &mut Pool, req: &Request, stage: Stage) -> Result<Attempt> {
        let Request { rounded, key, stream, .. } = *req;
        // The preferred segment first; when it does not fit, just the request.
        let mut sizes = [self.preferred, rounded];
        let n = if self.preferred == rounded { 1 } else { 2 };
        sizes[..n].sort_unstable_by(|a, b| b.cmp(a));
        let mut by_limit = false;
        for &seg_size in &sizes[..n] {
            if stage == Stage::AsIs {
                pool.decay_before_grow(seg_size, key, stream);
            }
            let Some(got) = pool.within_budget(seg_size, |up| up.allocate(seg_size, stream)) else {
                by_limit = seg_size == rounded;
                continue;
            };
            match got {
                Ok(base) => {
                    pool.book_segment(base, seg_size, stream);
                    if key != StreamKey::LEGACY && pool.core.upstream().stream_ordered() {
                        // Stream-ordered upstreams make the memory valid on `stream` only;
                        // cover it so another stream reusing the remainder waits. (Other
                        // upstreams' memory is idle when it arrives: nothing to cover.)
                        let _ = pool.core.record_now(key, stream);
                    }
                    let seg = Segment { base, size: seg_size, stream: key };
                    return Ok(Attempt::Served(pool.core.strategy_mut().add_segment(seg, rounded)));
                }
                Err(AllocError::OutOfMemory) => by_limit = false,
                Err(AllocError::Other(e)) => return Err(e),
            }
        }
        Ok(Attempt::Refused { by_limit })
    }

    fn before_release(&self, _pool: &mut Pool, stage: Stage, covered: bool) -> bool {
        stage == Stage::ReleaseSome && covered
    }

    fn release(&self, pool: &mut Pool, _req: &Request, stage: Stage) -> Result<bool> {
        // A release the driver refuses keeps its segment for later; the request may still
        // be served by what did go back or by the upstream.
        let want = if stage == Stage::ReleaseSome { Some(self.preferred) } else { None };
        let _ = pool.release_cached(want);
        Ok(true)
    }
}

impl Pool {
    /// May the pool wait for the whole device now? The graph-pool layer says
    /// (`PrivatePools::device_sync_allowed`).
    pub(super) fn device_sync_allowed(&self) -> bool {
        // Another pool of the device may route a capture (a tag's: Note [Graph pools under
        // a tag]) that a device-wide wait would invalidate.
        self.graphs.device_sync_allowed() && !self.limits.budget().routes_active()
    }

    /// Under memory pressure (the upstream or the limit refused new memory): blocks freed
    /// on streams no event covers (their frees came after the stream may have gone: see
    /// `StreamTracker::on_free_unrecorded`) become usable everywhere after one device-wide
    /// wait. Never on a path that is not already failing to grow, so a steady state makes
    /// no such call. Returns whether it waited.
    pub(super) fn cover_by_device_sync(&mut self) -> bool {
        self.core.streams().has_uncovered() && self.wait_for_device().is_ok()
    }

    /// Wait for the whole device, if a wait may be made now (`device_sync_allowed`); every
    /// free so far is then done, so every stream's blocks are covered.
    pub(super) fn wait_for_device(&mut self) -> Result<()> {
        if !self.device_sync_allowed() {
            return Err(Error::Internal("no device-wide wait may be made while a capture may run".into()));
        }
        self.core.synchronize_device()
    }

    pub(super) fn find_or_grow(&mut self, size: usize, rounded: usize, key: StreamKey, stream: StreamHandle) -> Result<Block> {
        if let Some(b) = self.core.take_cached(rounded, key, stream) {
            return Ok(b);
        }
        if self.core.unfenced_full() {
            self.fence_unfenced();
            if let Some(b) = self.core.take_cached(rounded, key, stream) {
                return Ok(b);
            }
        }
        if self.core.strategy_mut().flush_deferred() {
            if let Some(b) = self.core.take_cached(rounded, key, stream) {
                return Ok(b);
            }
        }
        // Reusable blocks kept in thread caches before new memory: the fast path never makes
        // the pool grow. (Unfenced CuPy frees could not serve this request; pressure below
        // takes them too.)
        if self.caches.enabled() && self.caches.any_reusable() {
            for (p, hold) in self.caches.take_all_kept(true) {
                self.release_kept(p, hold, Some(stream));
            }
            self.core.strategy_mut().flush_deferred();
            if let Some(b) = self.core.take_cached(rounded, key, stream) {
                return Ok(b);
            }
        }
        // Memory freed after its stream may have gone serves only that stream until a
        // device-wide wait; once it amounts to a quarter of what the pool holds (64 MiB at
        // least), one wait before growing lets every stream use it, so a program that keeps
        // creating and destroying streams does not grow the pool to the whole device. (At
        // most one wait per that many bytes of such frees, and only where the pool would
        // grow: never in a steady state.)
        if self.core.streams().unrecorded_bytes() >= (self.rec.c.reserved / 4).max(UNRECORDED_WAIT_MIN) && self.cover_by_device_sync() {
            if let Some(b) = self.core.take_cached(rounded, key, stream) {
                return Ok(b);
            }
        }
        self.grow(size, rounded, key, stream, true)
    }

    /// Serve the request with new memory, escalating when the upstream or the limit
    /// refuses (`escalate`): a new segment carved for it, or, in the arena, a mapped window
    /// (`arena.rs`). `retake`: between stages, try the cache again (false when the cached
    /// candidate is known not to fit).
    pub(super) fn grow(&mut self, size: usize, rounded: usize, key: StreamKey, stream: StreamHandle, retake: bool) -> Result<Block> {
        let req = Request { size, rounded, key, stream };
        if self.core.is_arena() {
            // The arena covers them only where its growth calls the driver: most of its
            // growths in a steady state are served from mapped memory with no call.
            return self.escalate(&req, retake, &ArenaGrowth);
        }
        self.cover_own_frees(key, stream);
        let preferred = match self.core.strategy().segment_size(rounded) {
            Some(s) => s,
            None => return Err(self.oom(size, rounded, false)),
        };
        self.escalate(&req, retake, &SegmentGrowth { preferred })
    }

    /// Before a growth that calls the driver, or a release that must wait for the streams
    /// whose memory it gives back: this call names the stream, so it is alive now; cover
    /// its earlier frees (those left pending or uncovered) with its event, so that other
    /// streams may use them, and a release waits for that event, not for the whole device.
    /// One event record, beside the driver calls the growth or release makes anyway. (Not
    /// while the stream captures a graph: an event recorded there belongs to the graph.)
    pub(super) fn cover_own_frees(&mut self, key: StreamKey, stream: StreamHandle) {
        if key != StreamKey::LEGACY && self.core.streams().is_uncovered(key) && !self.capturing(stream, true) {
            let _ = self.core.record_now(key, stream);
        }
    }

    /// The out-of-memory escalation of every growth path of the main cache: serve as is;
    /// then, twice, flush the thread caches and fence CuPy's frees, wait for the device
    /// where frees no event covers could serve (first time) or finish the deferred frees,
    /// waiting (second time), release cached memory (some, then all), trying the cache
    /// around that release where `how` says, and serve again; then out of memory.
    fn escalate(&mut self, req: &Request, retake: bool, how: &impl Grower) -> Result<Block> {
        let Request { size, rounded, key, stream } = *req;
        let mut by_limit = false;
        // The last attempt found no room at all (the arena: no window in its address space).
        let mut no_room = false;
        for stage in [Stage::AsIs, Stage::ReleaseSome, Stage::ReleaseAll] {
            if stage != Stage::AsIs {
                self.flush_thread_caches(Some(stream));
                // What the requester's thread cache held is now its stream's pending
                // frees: its event covers them, not the device-wide wait below.
                self.cover_own_frees(key, stream);
                self.fence_unfenced();
                // Blocks no event covers may serve once the device is idle: before any
                // memory goes back.
                let covered = if stage == Stage::ReleaseSome {
                    self.cover_by_device_sync()
                } else {
                    self.finish_pending(true);
                    false
                };
                if how.before_release(self, stage, covered) && retake {
                    if let Some(b) = self.core.take_cached(rounded, key, stream) {
                        return Ok(b);
                    }
                }
                // A request larger than the limit or the whole device fails whatever is
                // given back: the cache (and the arena's stitches over it) stays. (Checked
                // only now: memory reserved before the limit was lowered may still serve it
                // once the waits above made it reusable.)
                if stage == Stage::ReleaseSome {
                    if let Some(l) = self.never_fits(rounded) {
                        let mut e = self.oom(size, rounded, l);
                        if let Error::OutOfMemory(r) = &mut e {
                            r.hopeless = true;
                        }
                        return Err(e);
                    }
                }
                if how.release(self, req, stage)? && retake {
                    if let Some(b) = self.core.take_cached(rounded, key, stream) {
                        return Ok(b);
                    }
                }
            }
            match how.serve(self, req, stage)? {
                Attempt::Served(b) => return Ok(b),
                Attempt::Refused { by_limit: l } => (by_limit, no_room) = (l, false),
                Attempt::Nothing => no_room = true,
            }
        }
        let mut e = self.oom(size, rounded, by_limit);
        if let (Error::OutOfMemory(r), true) = (&mut e, no_room && !by_limit) {
            r.address_space_full = self.arena_large_range();
        }
        Err(e)
    }

    /// `Some(by_limit)` where `rounded` bytes exceed the limit or, in the arena, the device's
    /// memory or the address range any block must fit in. (Not the device's memory for the
    /// other pools: a managed upstream may hand out more than the device holds.)
    fn never_fits(&self, rounded: usize) -> Option<bool> {
        let limit = self.limits.limit();
        if limit > 0 && rounded > limit {
            return Some(true);
        }
        self.arena_never_fits(rounded).then_some(false)
    }

    /// Book a segment the upstream just gave (`size` bytes at `base`, asked for on `stream`):
    /// the address index, the trace and the counters.
    pub(super) fn book_segment(&mut self, base: usize, size: usize, stream: StreamHandle) {
        self.core.index_range(base, size);
        self.trace(stream, Action::UpstreamAlloc, base, size);
        self.add_reserved(size);
        self.rec.c.upstream_allocs += 1;
        self.rec.c.upstream_alloc_bytes += size as u64;
    }

    /// Ask the upstream for `bytes` of new memory with `get`, within the device's budget:
    /// `None` when the limit refuses (the upstream is not asked); a refusal by the upstream
    /// gives the claim back. On success the caller books the bytes (`add_reserved`).
    pub(super) fn within_budget<T, E>(
        &mut self,
        bytes: usize,
        get: impl FnOnce(&mut dyn crate::upstream::Upstream) -> std::result::Result<T, E>,
    ) -> Option<std::result::Result<T, E>> {
        self.limits.within(bytes, self.core.upstream_mut(), get)
    }

    /// `bytes` claimed from the device's budget (`within_budget`) arrived from the upstream.
    pub(super) fn add_reserved(&mut self, bytes: usize) {
        self.rec.c.add_reserved(bytes);
        self.limits.confirm();
    }

    /// `bytes` went back to the upstream.
    pub(super) fn sub_reserved(&mut self, bytes: usize) {
        self.rec.c.reserved -= bytes;
        self.limits.released(bytes);
    }

    pub(super) fn oom(&mut self, requested: usize, rounded: usize, by_limit: bool) -> Error {
        self.rec.c.ooms += 1;
        self.trace(0, Action::Oom, 0, requested);
        Error::OutOfMemory(Box::new(OomReport {
            device: self.core.device(),
            requested,
            rounded,
            reserved: self.rec.c.reserved,
            in_use: self.rec.c.used,
            cached: self.core.cached_committed(),
            largest_free_block: self.core.strategy().largest_free_block(),
            limit: self.limits.limit(),
            device_free_total: self.core.upstream_mut().mem_info().ok(),
            by_limit,
            strategy: self.core.strategy().name(),
            hopeless: false,
            granule: self.arena_granule(),
            address_space_full: None,
        }))
    }
}
