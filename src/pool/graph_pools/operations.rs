//! The routing layer's operations, `Pool` methods since they reach the core's upstream and
//! live map, the limits and the counters: routing an allocation (`graph_pools/routes.rs`
//! holds the routes), the captures nobody announced (CuPy's own `begin_capture`) and what
//! a capture in progress forbids (events recorded on a capturing stream, device-wide waits,
//! frees whose extra streams capture, held until the last route ends); and the private
//! pools' memory: allocation, growth, frees and release.

use super::routes::{Filter, Route, ACTIVE_ROUTES};
use super::{private_segment, PoolId, PrivatePool, IMPLICIT_POOL_TAG};
use crate::block::{Block, Segment};
use crate::error::{Error, Result};
use crate::pool::{Live, Pool, NO_OWNER};
use crate::strategy;
use crate::stream::{StreamHandle, StreamKey};
use crate::trace::Action;
use crate::upstream::AllocError;
use crate::upstream::capture_routes;
use std::ffi::c_void;
use std::sync::atomic::Ordering;

impl Pool {
    /// Route allocations that `filter` accepts to the private pool `id` (made if new; one
    /// more use) until `end_allocate_to_pool(id)`.
    pub fn begin_allocate_to_pool(&mut self, id: PoolId, filter: Filter) -> Result<()> {
        self.running()?;
        self.graphs.pools.entry(id).or_insert_with(|| PrivatePool::new(0)).uses += 1;
        self.graphs.routes.push(Route { id, filter });
        ACTIVE_ROUTES.fetch_add(1, Ordering::AcqRel);
        self.limits.budget().route_began();
        capture_routes::began(self.core.device());
        self.core.upstream_mut().set_capture_relaxed(true);
        Ok(())
    }

    /// One more use of the private pool `id`, made if new (PyTorch's `MemPool` constructor):
    /// kept until as many `release_pool` calls.
    pub fn create_or_incref_pool(&mut self, id: PoolId) -> Result<()> {
        self.running()?;
        self.graphs.pools.entry(id).or_insert_with(|| PrivatePool::new(0)).uses += 1;
        Ok(())
    }

    /// The uses of the private pool `id` (0 when it does not exist).
    pub fn pool_use_count(&self, id: PoolId) -> i64 {
        self.graphs.pools.get(&id).map_or(0, |p| p.uses)
    }

    /// Stop routing to `id` (the latest route to it). Allocations go to the main cache again.
    pub fn end_allocate_to_pool(&mut self, id: PoolId) -> Result<()> {
        let Some(i) = self.graphs.routes.iter().rposition(|r| r.id == id) else {
            return Err(Error::InvalidArgument(format!("no allocation to private pool {id:?} is in progress on device {}", self.core.device())));
        };
        self.graphs.routes.remove(i);
        ACTIVE_ROUTES.fetch_sub(1, Ordering::AcqRel);
        self.limits.budget().routes_ended(1);
        capture_routes::ended(self.core.device(), 1);
        if self.graphs.routes.is_empty() {
            self.core.upstream_mut().set_capture_relaxed(false);
        }
        self.settle_after_captures();
        Ok(())
    }

    /// Once no route is active on the device (in any of its pools): frees held past a
    /// capture get their events, and private pools nobody uses go back.
    pub fn settle_after_captures(&mut self) {
        if !self.limits.budget().routes_active() {
            self.replay_capture_deferred();
            self.release_unused_private_pools();
        }
    }

    /// Frees held past a capture (`defer_past_capture`), now that no route is active: their
    /// extra streams get events as in any free.
    fn replay_capture_deferred(&mut self) {
        for (block, extra) in std::mem::take(&mut self.graphs.capture_deferred) {
            let mut events = Vec::new();
            let mut uncovered = false;
            for &h in &extra {
                match self.core.record_on(h) {
                    Ok(ev) => events.push(ev),
                    Err(_) => uncovered = true,
                }
            }
            if uncovered {
                // No event says when that stream's work is done: wait for the whole device,
                // or, where none may be made now, hold the free for the next replay.
                if self.wait_for_device().is_err() {
                    for ev in events {
                        self.core.recycle_event(ev);
                    }
                    self.graphs.capture_deferred.push((block, extra));
                    continue;
                }
            }
            if events.is_empty() {
                let _ = self.put_block(block, None);
            } else {
                self.core.defer(block, events);
            }
        }
    }

    /// Hold a main-pool free until no route is active (see `capture_deferred`).
    pub(in crate::pool) fn defer_past_capture(&mut self, block: Block, extra: Vec<StreamHandle>) {
        self.graphs.capture_deferred.push((block, extra));
    }

    /// Which private pool an allocation on `stream` goes to, if a route takes it. The capture
    /// id is asked at most once per call.
    pub(in crate::pool) fn route(&mut self, stream: StreamHandle) -> Result<Option<PoolId>> {
        let mut capture: Option<Option<u64>> = None;
        let mut key: Option<StreamKey> = None;
        for i in (0..self.graphs.routes.len()).rev() {
            let hit = match &self.graphs.routes[i].filter {
                Filter::Capture(cid) => {
                    let cid = *cid;
                    if capture.is_none() {
                        capture = Some(self.core.upstream_mut().capture_id(stream)?);
                    }
                    capture == Some(Some(cid))
                }
                Filter::Stream(k) => {
                    let k = *k;
                    if key.is_none() {
                        key = Some(self.core.key(stream)?);
                    }
                    key == Some(k)
                }
                // SAFETY: the creator's predicate with its own context.
                Filter::Callback(cb) => unsafe { (cb.call)(cb.ctx, stream as *mut c_void) != 0 },
            };
            if hit {
                return Ok(Some(self.graphs.routes[i].id));
            }
        }
        Ok(None)
    }

    /// Whether `stream` is capturing a graph, asked only while routes are active (or when
    /// the caller asks, `check`): frees there must not record events.
    pub(in crate::pool) fn capturing(&mut self, stream: StreamHandle, check: bool) -> bool {
        let routed = self.graphs.has_routes() || self.limits.budget().routes_active();
        if !(check || routed) || crate::stream::is_legacy(stream) {
            return false;
        }
        let capture = self.core.upstream_mut().capture_id(stream).ok().flatten();
        if !routed {
            // A capture nobody announced (a route on the device announces its own, which
            // must not be kept here past its end).
            self.graphs.note_capture(stream, capture);
        }
        capture.is_some()
    }

    /// The capture sequence `stream` takes part in, if it is capturing.
    pub(crate) fn capture_of(&mut self, stream: StreamHandle) -> Result<Option<u64>> {
        self.core.upstream_mut().capture_id(stream)
    }

    /// The pool's identity for `stream`.
    pub fn stream_key(&mut self, stream: StreamHandle) -> Result<StreamKey> {
        self.core.key(stream)
    }

    /// CuPy's allocation on its current stream: a route takes it first; else a stream that
    /// captures a graph nobody announced gets a private pool for that capture (released by
    /// `gpupool_release_capture`), since the graph keeps using what it was given.
    pub fn malloc_detecting_capture(&mut self, size: usize, stream: StreamHandle) -> Result<usize> {
        self.running()?;
        if size != 0 && !crate::stream::is_legacy(stream) {
            if self.graphs.has_routes() {
                if let Some(id) = self.route(stream)? {
                    return self.malloc_private(size, stream, id);
                }
            }
            let capture = self.core.upstream_mut().capture_id(stream)?;
            if !self.graphs.has_routes() {
                self.graphs.note_capture(stream, capture);
            }
            if let Some(cid) = capture {
                return self.malloc_private(size, stream, (cid, IMPLICIT_POOL_TAG));
            }
        }
        self.malloc(size, stream)
    }
}

impl Pool {
    /// Whether private pool `id` lives in this pool (the registry finds a pool's home).
    pub(crate) fn holds_private_pool(&self, id: PoolId) -> bool {
        self.graphs.pools.contains_key(&id)
    }

    /// Whether a route of this pool sends allocations to one of its private pools now.
    pub(crate) fn routes_allocations(&self) -> bool {
        self.graphs.has_routes()
    }

    /// An allocation a route of this pool takes, from its private pool; `None` (nothing
    /// allocated) where no route takes it.
    pub(crate) fn malloc_if_routed(&mut self, size: usize, stream: StreamHandle) -> Result<Option<usize>> {
        self.running()?;
        if size == 0 || !self.graphs.has_routes() {
            return Ok(None);
        }
        match self.route(stream)? {
            Some(id) => {
                self.not_paused()?;
                self.malloc_private(size, stream, id).map(Some)
            }
            None => Ok(None),
        }
    }

    /// Keep a private block out of reuse until its pool goes (see `quarantined`).
    pub(in crate::pool) fn quarantine_private(&mut self, block: Block, id: PoolId) -> Result<()> {
        let Some(pool) = self.graphs.pools.get_mut(&id) else {
            return Err(Error::Internal(format!("block {:#x} names private pool {id:?}, which is gone", block.addr)));
        };
        pool.live -= 1;
        pool.quarantined.push(block);
        self.destroy_if_unused(id).map(|_| ())
    }

    /// Release every private pool nobody uses and nothing in it is live (after the last
    /// route ended, or on reclaim). Best effort: a refusal keeps the pool for later.
    pub(crate) fn release_unused_private_pools(&mut self) {
        let ids: Vec<PoolId> = self.graphs.pools.iter().filter(|(_, p)| p.uses <= 0 && p.live == 0).map(|(id, _)| *id).collect();
        for id in ids {
            let _ = self.destroy_if_unused(id);
        }
    }

    /// One user of `id` is done with it (a graph destroyed, a `MemPool` deleted). With no
    /// use left and no live block, its memory goes back. Unknown ids are ignored (PyTorch
    /// releases pools it never routed to us).
    pub fn release_pool(&mut self, id: PoolId) -> Result<usize> {
        self.running()?;
        // (While a route is active, `destroy_if_unused` waits: the last route's end does it.)
        let Some(p) = self.graphs.pools.get_mut(&id) else { return Ok(0) };
        p.uses -= 1;
        if id.1 == IMPLICIT_POOL_TAG && p.uses <= 0 {
            // Its owner says the capture is over.
            self.graphs.unannounced.retain(|_, c| *c != id.0);
        }
        self.destroy_if_unused(id)
    }

    /// Give the private pool `id`'s memory back if nothing uses it and none of its blocks
    /// is live (PyTorch's `emptyCache(mempool_id)`); a pool still in use keeps its segments
    /// for its graphs. The bytes released.
    pub fn empty_private_pool(&mut self, id: PoolId) -> Result<usize> {
        self.running()?;
        self.destroy_if_unused(id)
    }

    /// Allocate from the private pool `id` for `stream` (never from the main cache).
    pub(in crate::pool) fn malloc_private(&mut self, size: usize, stream: StreamHandle, id: PoolId) -> Result<usize> {
        self.running()?;
        let key = self.core.key(stream)?;
        // An implicit capture pool starts with one use: kept until released by id.
        let pool = self.graphs.pools.entry(id).or_insert_with(|| PrivatePool::new(1));
        let Some(rounded) = pool.strategy.round(size) else { return Err(self.oom(size, size, false)) };
        // Same stream only: a graph's order protects reuse on its own stream, and no event
        // may be asked about during a capture.
        let mut same = |from: StreamKey, _: usize, _: usize| from == key;
        let mut block = match pool.strategy.take(rounded, key, &mut same) {
            Some(b) => b,
            None => self.grow_private(size, rounded, key, stream, id)?,
        };
        block.stream = key;
        let pool = self.graphs.pools.get_mut(&id).expect("present");
        pool.live += 1;
        self.rec.c.used += block.size;
        self.rec.c.requested += size;
        self.bump_peaks();
        self.rec.c.allocs += 1;
        let rec = self.rec.alloc_record(stream);
        self.core.insert_live(Live { block, requested: size, extra_streams: Vec::new(), rec, owner: NO_OWNER, handle: stream, private: Some(id) });
        self.trace(stream, Action::Alloc, block.addr, size);
        self.verify();
        Ok(block.addr)
    }

    /// A new segment for a private pool. Out of memory releases the main cache once and
    /// retries (the releases wait for events recorded outside any capture). Not through
    /// `Pool::escalate`: its stages wait for the whole device and finish deferred frees,
    /// which a capture in progress forbids, and serve from the main cache, which a private
    /// pool's block must not come from.
    fn grow_private(&mut self, size: usize, rounded: usize, key: StreamKey, stream: StreamHandle, id: PoolId) -> Result<Block> {
        // An implicit capture pool grows with no route active: relax for this growth too.
        self.core.upstream_mut().set_capture_relaxed(true);
        let r = self.grow_private_relaxed(size, rounded, key, stream, id);
        let routed = self.graphs.has_routes();
        self.core.upstream_mut().set_capture_relaxed(routed);
        r
    }

    fn grow_private_relaxed(&mut self, size: usize, rounded: usize, key: StreamKey, stream: StreamHandle, id: PoolId) -> Result<Block> {
        let pool = self.graphs.pools.get_mut(&id).expect("present");
        let Some(seg_size) = pool.strategy.segment_size(rounded) else { return Err(self.oom(size, rounded, false)) };
        let mut by_limit = false;
        for attempt in 0..2 {
            if attempt == 1 {
                self.flush_thread_caches(Some(stream));
                self.fence_unfenced();
                let _ = self.release_cached(None);
            }
            for want in if seg_size == rounded { vec![rounded] } else { vec![seg_size, rounded] } {
                // Mapped segments are whole allocations of the arena's granule, as the rest
                // of a tag's memory is (Note [A tag's granule]).
                let want = if self.graphs.mapped { want.next_multiple_of(self.arena_granule().max(1)) } else { want };
                // A stream-ordered upstream (cuMemAllocAsync) would put the allocation into the
                // graph being captured: allocate on the legacy stream, outside any capture.
                let on = if self.core.upstream().stream_ordered() { crate::stream::STREAM_LEGACY } else { stream };
                let mapped = self.graphs.mapped;
                let Some(got) = self.within_budget(want, |up| private_segment(up, mapped, want, on)) else {
                    by_limit = want == rounded;
                    continue;
                };
                match got {
                    Ok(base) => {
                        self.book_segment(base, want, stream);
                        let pool = self.graphs.pools.get_mut(&id).expect("present");
                        pool.reserved += want;
                        return Ok(pool.strategy.add_segment(Segment { base, size: want, stream: key }, rounded));
                    }
                    Err(AllocError::OutOfMemory) => by_limit = false,
                    Err(AllocError::Other(e)) => return Err(e),
                }
            }
        }
        Err(self.oom(size, rounded, by_limit))
    }

    /// Take back a block of the private pool `id` (freed on `key`; no event recorded).
    pub(in crate::pool) fn free_private(&mut self, block: Block, id: PoolId) -> Result<()> {
        let Some(pool) = self.graphs.pools.get_mut(&id) else {
            return Err(Error::Internal(format!("block {:#x} names private pool {id:?}, which is gone", block.addr)));
        };
        pool.live -= 1;
        if let Some(seg) = pool.strategy.put(block) {
            // Split never returns segments from `put`; kept for the contract's sake.
            pool.reserved -= seg.size;
            self.core.deallocate_private(seg, self.graphs.mapped)?;
            self.sub_reserved(seg.size);
        }
        self.destroy_if_unused(id).map(|_| ())
    }

    /// Release the private pool `id` if nobody uses it and nothing in it is live: wait for
    /// the device once, then give every segment back.
    fn destroy_if_unused(&mut self, id: PoolId) -> Result<usize> {
        let Some(p) = self.graphs.pools.get(&id) else { return Ok(0) };
        // While any route is active a capture may be running, which a device-wide
        // synchronisation would invalidate: the last route's end releases the pool. While
        // the pool is paused its segments are unmapped already: the resume releases it.
        if p.uses > 0 || p.live > 0 || !self.device_sync_allowed() || self.is_paused() {
            return Ok(0);
        }
        if p.reserved > 0 {
            self.wait_for_device()?;
        }
        let mut p = self.graphs.pools.remove(&id).expect("present");
        // Nothing is live, so every segment is wholly free, though its free blocks may carry
        // different streams (and so not have merged): after the synchronisation none of
        // them matters. Release segment by segment; the strategy is dropped with the pool.
        let mut segments: Vec<usize> =
            p.strategy.free_blocks().iter().chain(p.quarantined.iter()).map(|b| b.segment).collect();
        segments.sort_unstable();
        segments.dedup();
        let mut released = 0;
        let mut first_err = None;
        let mut kept = Vec::new();
        for base in segments {
            let len = p.strategy.segment_len(base).expect("private pools are split pools, which know their segments");
            // Every queued use finished (synchronised above): release on the legacy stream.
            let seg = Segment { base, size: len, stream: StreamKey::LEGACY };
            match self.core.deallocate_private(seg, self.graphs.mapped) {
                Ok(_) => {
                    self.trace(0, Action::UpstreamFree, base, len);
                    self.sub_reserved(len);
                    self.rec.c.upstream_frees += 1;
                    self.rec.c.reclaimed_bytes += len as u64;
                    p.reserved -= len;
                    released += len;
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                    kept.push(base);
                }
            }
        }
        if !kept.is_empty() {
            // The driver refused: keep those segments (and only those) in a fresh pool that
            // nobody routes to, so the books stay exact; a later release retries.
            let mut fresh = strategy::build(crate::config::PoolKind::Split);
            for base in kept {
                let len = p.strategy.segment_len(base).expect("known above");
                let b = fresh.add_segment(Segment { base, size: len, stream: StreamKey::LEGACY }, len);
                let _ = fresh.put(b);
            }
            p.strategy = fresh;
            p.quarantined.clear();
        }
        if p.reserved > 0 {
            // What could not be released stays reserved in a pool nobody routes to, so
            // the books stay exact; a later release attempt retries.
            p.uses = 0;
            self.graphs.pools.insert(id, p);
        }
        self.verify();
        match first_err {
            Some(e) => Err(e),
            None => Ok(released),
        }
    }

    /// Give back every private pool nobody uses (teardown).
    pub(in crate::pool) fn release_private_pools(&mut self) {
        let ids: Vec<PoolId> = self.graphs.pools.keys().copied().collect();
        for id in ids {
            if let Some(p) = self.graphs.pools.get_mut(&id) {
                p.uses = p.uses.min(0);
            }
            let _ = self.destroy_if_unused(id);
        }
    }

    /// Private pools for the status report: `(pools, reserved bytes, free bytes)`.
    pub fn private_pool_summary(&self) -> (usize, usize, usize) {
        (self.graphs.count(), self.graphs.reserved_bytes(), self.graphs.cached_bytes())
    }
}
