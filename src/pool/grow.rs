//! Finding memory for a request: the cache first, then PyTorch's escalation order (flush
//! deferred frees, thread caches' reusable blocks, a device-wide wait where frees no event
//! covers would otherwise make the pool grow, new segments, releasing some cached memory,
//! then all of it) and the out-of-memory report. The escalation is one loop (`escalate`)
//! for every growth path of the main cache, both here: segment pools reserve segments
//! (`SegmentGrowth`), the arena maps windows and stitches (`ArenaGrowth` and the arena's
//! driver calls below it). These are `Pool` methods because growth meets every layer: the
//! core's cache and upstream, the limits' claims, the thread caches' kept blocks, and the
//! graph-pool layer's word on whether the device may be waited for.

use super::growth::{Attempt, Grower, Request, Stage};
use super::{Pool, UNRECORDED_WAIT_MIN};
use crate::block::{Block, Segment};
use crate::error::{Error, OomReport, Result};
use crate::strategy::arena::{plan::adjacent_runs, plan::Window, ArenaStrategy, Growth, PlanRules};
use crate::stream::{StreamHandle, StreamKey};
use crate::trace::Action;
use crate::upstream::{AliasFail, AllocError};

/// Why a growth failed.
enum GrowFail {
    /// Not enough memory (device or limit): release or flush, then retry.
    OutOfMemory { by_limit: bool },
    Other(Error),
}

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

/// Growth of the arena (`Pool::escalate`): a window of its ranges mapped (new memory, or
/// the other range's free granules lent), stitches of free granules, spilled small blocks.
struct ArenaGrowth;

impl Grower for ArenaGrowth {
    fn serve(&self, pool: &mut Pool, req: &Request, stage: Stage) -> Result<Attempt> {
        let Request { rounded, key, stream, .. } = *req;
        if stage == Stage::AsIs {
            // Decay trims before planning: a release after it could unmap what the plan
            // counts on.
            pool.decay_before_grow(rounded, key, stream);
        }
        // Once memory had to be released for this request, new memory is mapped granule by
        // granule: a chunk partly in use could be neither stitched nor released later.
        let chunking = stage == Stage::AsIs;
        // While other shards' growths contend for the driver, small requests get new memory
        // rather than new stitches (`contention.rs`); not once memory had to be released,
        // nor where new memory is refused or no window is allowed (below): there a stitch
        // serves with memory already held.
        let contended = stage == Stage::AsIs && pool.budget().contention().contended();
        if let Some(b) = pool.with_arena_gate(key, stream, |a, gate| a.take_spilled_unplanned(rounded, key, gate)) {
            return Ok(Attempt::Served(b));
        }
        // Plan and serve; an eviction (stitch cache full) plans again. One that fails (its
        // stream's work cannot be waited for now) is not planned again in this growth: the
        // same stitch would be chosen forever.
        let mut rules = PlanRules { small_stitches: !contended, ..PlanRules::default() };
        loop {
            let plan = pool.with_arena_gate(key, stream, |a, gate| a.plan(rounded, key, rules, gate));
            let served = match plan {
                None if !rules.small_stitches => {
                    rules.small_stitches = true;
                    continue;
                }
                // Piece ends were held back for a full stitch cache (`plan`); where nothing
                // else serves, they may evict.
                None if !rules.pieces_when_full && pool.arena_ref().piece_ends() => {
                    rules.pieces_when_full = true;
                    continue;
                }
                None => return Ok(Attempt::Nothing),
                Some(Growth::Evict { id }) => {
                    // Removing the aliases waits for the stream that last freed the stitch;
                    // when that is this one, its frees are covered first (an event, not a
                    // device-wide wait). A stitch whose alias removal failed is left broken
                    // (never chosen again); one whose stream could not be waited for stays
                    // cached.
                    if pool.arena_ref().stitch_last_stream(id) == Some(key) {
                        pool.cover_own_frees(key, stream);
                    }
                    if pool.drop_stitch(id).is_err() {
                        rules.may_evict = false;
                    }
                    continue;
                }
                Some(Growth::Reuse { id, first, granules }) => Ok(pool.arena().carve_stitch(id, first, granules, rounded, key, true)),
                Some(Growth::Stitch { base, homes, fresh, take, head, tail }) => {
                    let budget = pool.budget().clone();
                    let _calls = budget.contention().begin();
                    pool.cover_own_frees(key, stream);
                    pool.make_stitch(base, homes, &fresh, (take, head, tail), req, chunking)
                }
                Some(Growth::Window { space, window }) => {
                    let spilled = if window.targets.is_empty() {
                        None
                    } else {
                        pool.with_arena_gate(key, stream, |a, gate| a.take_spilled(rounded, key, gate))
                    };
                    match spilled {
                        Some(b) => Ok(b),
                        None => {
                            // Only a window over unmapped granules makes driver calls.
                            let budget = (!window.targets.is_empty()).then(|| pool.budget().clone());
                            let _calls = budget.as_ref().map(|b| b.contention().begin());
                            if budget.is_some() {
                                pool.cover_own_frees(key, stream);
                            }
                            pool.map_window(&window, key, stream, chunking).map(|()| pool.arena().carve_window(space, &window, key))
                        }
                    }
                }
            };
            return match served {
                Ok(b) => Ok(Attempt::Served(b)),
                Err(GrowFail::OutOfMemory { .. }) if !rules.small_stitches => {
                    rules.small_stitches = true;
                    continue;
                }
                // The window taken for a full stitch cache was refused: pieces need less.
                Err(GrowFail::OutOfMemory { .. }) if !rules.pieces_when_full && pool.arena_ref().piece_ends() => {
                    rules.pieces_when_full = true;
                    continue;
                }
                Err(GrowFail::OutOfMemory { by_limit }) => Ok(Attempt::Refused { by_limit }),
                Err(GrowFail::Other(e)) => Err(e),
            };
        }
    }

    fn before_release(&self, pool: &mut Pool, _stage: Stage, _covered: bool) -> bool {
        // What the stages moved back joins the searchable books, and the cache is tried
        // before any granule goes back.
        pool.core.strategy_mut().flush_deferred();
        true
    }

    fn release(&self, pool: &mut Pool, req: &Request, stage: Stage) -> Result<bool> {
        // The limit or the device refused new memory: free granules this request could not
        // use (the other space's, edges of the other class) go back, some, then all. Those
        // it could use were stitched already.
        let want = if stage == Stage::ReleaseSome { Some(req.rounded) } else { None };
        Ok(pool.release_cached(want)? > 0)
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
    /// (`ArenaGrowth`, below). `retake`: between stages, try the cache again (false when the cached
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

/// The arena's driver calls: mapping a window or granules, making and dropping stitches.
impl Pool {
    /// The arena of an arena pool. The arena's pool side runs only for arena pools
    /// (`Pool::grow` picks `ArenaGrowth` where `Core::is_arena`; exports and releases ask
    /// `Core::arena` first).
    pub(super) fn arena(&mut self) -> &mut ArenaStrategy {
        self.core.arena_mut().expect("the arena's pool side runs for arena pools only")
    }

    pub(super) fn arena_ref(&self) -> &ArenaStrategy {
        self.core.arena().expect("the arena's pool side runs for arena pools only")
    }

    /// The arena's granule (0 for other pools): what out-of-memory reports name as the
    /// unit of mapping.
    pub(super) fn arena_granule(&self) -> usize {
        self.core.arena().map_or(0, |a| a.granule())
    }

    /// The bytes of the arena's large range (any block must fit there), for an
    /// out-of-memory report where no address space was left.
    fn arena_large_range(&self) -> Option<usize> {
        self.core.arena().map(|a| a.reservations()[1].1)
    }

    /// Whether `rounded` bytes can never fit this arena: over the device's memory as the
    /// arena read it at start (no bound where the driver would not say), or over the range
    /// any block must fit in. False for other pools.
    fn arena_never_fits(&self, rounded: usize) -> bool {
        let Some(arena) = self.core.arena() else { return false };
        let device = Some(arena.device_bytes()).filter(|&d| d > arena.granule());
        rounded > arena.largest_possible_block() || device.is_some_and(|d| rounded > d)
    }

    /// Run `f` on the arena with the reuse gate of a request on `stream` (`key`): free
    /// memory last used on another stream serves it only where the stream tracker makes it
    /// safe for this one (`StreamTracker::reuse_gate`).
    fn with_arena_gate<R>(&mut self, key: StreamKey, stream: StreamHandle, f: impl FnOnce(&mut ArenaStrategy, &mut dyn FnMut(StreamKey, usize, usize) -> bool) -> R) -> R {
        self.core.with_arena_gate(key, stream, f).expect("the arena's pool side runs for arena pools only")
    }

    /// Whether a growth of `len` may be mapped in chunks: only while the device's reserved
    /// memory stays within half of what it may hold (its memory, or the limit if lower).
    /// Why: a chunk partly in use can be neither stitched nor released, so near the limit
    /// the free memory in chunks could be stranded where granules would serve.
    fn arena_has_room_for_chunks(&self, len: usize) -> bool {
        let total = self.arena_ref().device_bytes();
        let cap = match self.limits.limit() {
            0 => total,
            l => l.min(total),
        };
        self.limits.budget().reserved() + len <= cap / 2
    }

    /// Back every unmapped granule of `window`: first with the other range's free granules
    /// (an alias each, no new memory: `ArenaStrategy::lendable`), then
    /// with new memory, one call per run of adjacent granules; the books follow each call
    /// that succeeded.
    /// `chunking`: whether long runs of new memory may be mapped as chunks (`map_granules`).
    fn map_window(&mut self, window: &Window, key: StreamKey, stream: StreamHandle, chunking: bool) -> std::result::Result<(), GrowFail> {
        let mut targets = window.targets.as_slice();
        if self.core.arena_lend() && !targets.is_empty() {
            let homes = self.with_arena_gate(key, stream, |a, gate| {
                a.lendable(a.space_of_addr(window.start), targets.len(), key, gate)
            });
            let g = self.arena().granule();
            // One alias call per run of adjacent targets (one access grant per run). The
            // homes are free memory their streams allowed to `stream`; aliasing them
            // disturbs no queued work. A refused run leaves the rest to new memory, and its
            // aliases made but not yet accessible are removed. One the driver will not
            // remove either (two failures in a row) is quarantined: booked as allocated so
            // nothing is placed over it, and its removal retried at the next release (as a
            // stitch in the same case is booked broken). A quarantined target is no longer
            // free to map: this request fails with the driver's error, and the next plans
            // around it.
            let mut done = 0;
            let mut stuck = None;
            for r in adjacent_runs(&targets[..homes.len()], g) {
                if let Err(f) = self.core.upstream_mut().vmm_alias(&homes[r.clone()], targets[r.start]) {
                    let mut quarantined = false;
                    for k in 0..f.made {
                        let at = targets[r.start] + k * g;
                        if self.core.upstream_mut().vmm_unalias(at, g).is_err() {
                            self.arena().quarantine(at, homes[r.start + k], key);
                            quarantined = true;
                        }
                    }
                    stuck = quarantined.then_some(f.error);
                    break;
                }
                for i in r.clone() {
                    self.arena().lend(targets[i], homes[i], key);
                    self.trace(stream, Action::Stitch, targets[i], g);
                }
                done = r.end;
            }
            // A quarantined alias's home is booked for this stream too (`quarantine`), and
            // is free memory of it once the alias goes: the same record covers it.
            let lent = done > 0 || stuck.is_some();
            targets = &targets[done..];
            if lent {
                // The lent granules are booked as free memory of this stream, though the
                // rest of each (what this request does not use) last served the homes'
                // streams, which this stream was only made to wait for. Its next record must
                // come after that wait, or another stream taking the rest on this stream's
                // event would not wait for them. (In a capture no record may be made: the
                // stream is left uncovered instead.)
                if self.capturing(stream, true) {
                    self.core.on_free_capturing(key, stream);
                } else {
                    let _ = self.core.record_now(key, stream);
                }
            }
            if let Some(error) = stuck {
                return Err(GrowFail::Other(error));
            }
        }
        self.map_granules(targets, key, stream, chunking)
    }

    /// Map new memory under the unmapped granules `t` (ascending): per run of adjacent
    /// ones, one call granule by granule, or one per chunk where the run is long
    /// (`ArenaStrategy::chunk_for`) while `chunking` allows.
    fn map_granules(&mut self, t: &[usize], key: StreamKey, stream: StreamHandle, chunking: bool) -> std::result::Result<(), GrowFail> {
        let g = self.arena().granule();
        let mut pieces = Vec::new();
        for r in adjacent_runs(t, g) {
            let (addr, len) = (t[r.start], r.len() * g);
            let chunk = self.arena().chunk_for(addr, len, chunking);
            if chunk <= g || !self.arena_has_room_for_chunks(len) {
                pieces.push((addr, len, false));
                continue;
            }
            // Pieces of equal length, none over `chunk`: no chunk of a granule or two at the
            // tail, and none over the largest.
            let k = len.div_ceil(chunk);
            let piece = (len / g).div_ceil(k) * g;
            let mut at = addr;
            while at < addr + len {
                let l = piece.min(addr + len - at);
                pieces.push((at, l, l > g));
                at += l;
            }
        }
        for (addr, len, chunked) in pieces {
            let Some(got) = self.within_budget(len, |up| if chunked { up.vmm_map_chunk(addr, len) } else { up.vmm_map_new(addr, len) }) else {
                return Err(GrowFail::OutOfMemory { by_limit: true });
            };
            match got {
                Ok(()) => {
                    if chunked {
                        self.arena().mapped_chunk(addr, len, key);
                    } else {
                        self.arena().mapped(addr, len, key);
                    }
                    self.add_reserved(len);
                    self.rec.c.upstream_allocs += 1;
                    self.rec.c.upstream_alloc_bytes += len as u64;
                    self.trace(stream, Action::UpstreamAlloc, addr, len);
                }
                Err(AllocError::OutOfMemory) => return Err(GrowFail::OutOfMemory { by_limit: false }),
                Err(AllocError::Other(e)) => return Err(GrowFail::Other(e)),
            }
        }
        Ok(())
    }

    /// Map `fresh`, alias `homes` side by side at `base` and hand the new stitch out. The
    /// homes are free memory whose streams the plan made safe for `stream`; nothing is
    /// unmapped, so no queued work is disturbed. `(take, head, tail)`: as `Growth::Stitch`'s.
    /// `chunking`: as `map_granules`'s, for the new memory under the stitch.
    fn make_stitch(&mut self, base: usize, homes: Vec<usize>, fresh: &[usize], (take, head, tail): (usize, usize, bool), req: &Request, chunking: bool) -> std::result::Result<Block, GrowFail> {
        let Request { rounded: bytes, key, stream, .. } = *req;
        let g = self.arena().granule();
        self.map_granules(fresh, key, stream, chunking)?;
        if let Err(AliasFail { made, error }) = self.core.upstream_mut().vmm_alias(&homes, base) {
            // Undo the aliases made (whole allocations), one mapping at a time. One the
            // driver will not remove is booked as a broken stitch over what was aliased, so
            // its address space is not reused while mapped and the removal is retried later.
            let made_homes = homes[..made].to_vec();
            let maps = self.arena().mappings_of(&made_homes);
            for (i, n) in maps {
                if self.core.upstream_mut().vmm_unalias(base + i * g, n * g).is_err() {
                    let id = self.arena().add_stitch(base, made_homes);
                    self.arena().stitch_broken(id, i);
                    break;
                }
            }
            return Err(GrowFail::Other(error));
        }
        self.trace(stream, Action::Stitch, base, homes.len() * g);
        let take = take.min(homes.len());
        let id = self.arena().add_stitch(base, homes);
        if head > 0 || tail {
            return Ok(self.arena().carve_pieced_stitch(id, head, tail, bytes, key));
        }
        Ok(self.arena().carve_stitch(id, 0, take, bytes, key, false))
    }

    /// Remove stitch `id`'s aliases and forget it (it is not handed out). The stream its
    /// block was last freed on is synchronised first: its kernels may still use the alias
    /// addresses. An alias the driver will not remove leaves the stitch broken (never handed
    /// out again, its address space kept) and the removal can be retried.
    pub(super) fn drop_stitch(&mut self, id: u32) -> Result<()> {
        if let Some(s) = self.arena().stitch_last_stream(id) {
            let allowed = self.device_sync_allowed();
            self.core.synchronize_stream(s, allowed)?;
        }
        let g = self.arena().granule();
        let (base, _, done) = self.arena().stitch_range(id);
        for (off, len) in self.arena().stitch_mappings(id) {
            if off / g < done {
                continue;
            }
            if let Err(e) = self.core.upstream_mut().vmm_unalias(base + off, len) {
                self.arena().stitch_broken(id, off / g);
                return Err(e);
            }
        }
        self.arena().drop_stitch(id);
        Ok(())
    }
}
