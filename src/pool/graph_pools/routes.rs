//! Routes: which allocations go to which private pool while its route is active (a capture
//! sequence, one stream, a caller's predicate), and the count of routes active in the
//! process, which the thread caches' fast path reads.

use super::PoolId;
use crate::stream::StreamKey;
use crate::upstream::capture_routes;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Routes active in the whole process: while any is, the thread caches step aside so that
/// every allocation reaches a pool that can route it (one relaxed load on the fast path).
pub(super) static ACTIVE_ROUTES: AtomicUsize = AtomicUsize::new(0);

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
    pub(super) id: PoolId,
    pub(super) filter: Filter,
}
