//! Routes: which allocations go to which private pool while its route is active (a capture
//! sequence, one stream, a caller's predicate), the captures nobody announced (CuPy's own
//! `begin_capture`), and what a capture in progress forbids: events recorded on a
//! capturing stream, device-wide waits, frees whose extra streams capture (held until the
//! last route ends).

use super::{PoolId, PrivatePool, IMPLICIT_POOL_TAG};
use crate::block::Block;
use crate::error::{Error, Result};
use crate::pool::Pool;
use crate::stream::{StreamHandle, StreamKey};
use crate::upstream::capture_routes;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Routes active in the whole process: while any is, the thread caches step aside so that
/// every allocation reaches a pool that can route it (one relaxed load on the fast path).
static ACTIVE_ROUTES: AtomicUsize = AtomicUsize::new(0);

pub fn routes_active() -> bool {
    ACTIVE_ROUTES.load(Ordering::Relaxed) != 0
}

/// `n` routes of `device` ended with their pool (dropped or reconfigured; the pool's
/// budget counts them apart).
pub(in crate::pool) fn forget_routes(device: i32, n: usize) {
    ACTIVE_ROUTES.fetch_sub(n, Ordering::AcqRel);
    capture_routes::ended(device, n);
}

/// A caller's predicate over stream handles (PyTorch's `std::function<bool(cudaStream_t)>`,
/// wrapped by `torch_shim.cpp`). `drop` frees `ctx` when the route ends.
pub struct Callback {
    pub call: unsafe extern "C" fn(ctx: *mut c_void, stream: *mut c_void) -> c_int,
    pub ctx: *mut c_void,
    pub drop: Option<unsafe extern "C" fn(ctx: *mut c_void)>,
}

// SAFETY: `ctx` is owned by the route and only used under the pool's lock; PyTorch's
// predicate only asks the driver about the stream, which is valid from any thread.
unsafe impl Send for Callback {}

impl Drop for Callback {
    fn drop(&mut self) {
        if let Some(d) = self.drop {
            // SAFETY: the creator handed us `ctx` with this destructor, to call once.
            unsafe { d(self.ctx) };
        }
    }
}

/// Which allocations a route takes.
pub enum Filter {
    /// Streams taking part in this capture sequence (`cuStreamGetCaptureInfo` id).
    Capture(u64),
    /// Exactly this stream (announced while not capturing: a `MemPool`-like scope).
    Stream(StreamKey),
    /// Whatever the caller's predicate accepts.
    Callback(Callback),
}

/// A route: allocations `filter` accepts go to the private pool `id`.
pub(super) struct Route {
    id: PoolId,
    filter: Filter,
}

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
