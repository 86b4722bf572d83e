//! CUDA graphs from C: private pools for allocations made while a stream captures.
//!
//! What is safe during capture (the header repeats it):
//! - Memory allocated *before* the capture may be used by captured kernels; keep it alive
//!   until the graph is destroyed (its replays use it).
//! - To allocate or free *during* a capture, announce it: after `cuStreamBeginCapture`,
//!   call `gpupool_begin_allocate_to_pool(device, id, stream)`; allocations on streams in
//!   that capture then come from private pool `id`, make no call that invalidates the
//!   capture, and stay out of eager use; `gpupool_end_allocate_to_pool` after
//!   `cuStreamEndCapture`, and `gpupool_release_pool` once the graph (every graph sharing
//!   `id`) is destroyed. Several captures may share one id when their graphs replay in
//!   capture order (as with PyTorch's `pool=`).
//! - Capture on a non-blocking stream: in global capture mode the legacy stream, which the
//!   pool may use for other threads' work, is off limits to a blocking capturing stream.

use super::boundary::call;
use crate::error::Status;
use crate::front::private_pools;
use std::ffi::{c_int, c_void};

/// Route allocations on `device` to the private pool `pool_id` until
/// `gpupool_end_allocate_to_pool(device, pool_id)`: those made on streams taking part in
/// the capture that `stream` is in, or, if `stream` is not capturing, those made on
/// `stream` itself. Each call counts one use of the pool (see `gpupool_release_pool`).
///
/// CUDA graph capture, what is safe:
/// - Memory allocated before a capture may be used by captured kernels; keep it allocated
///   until the graph is destroyed (every replay uses it).
/// - To allocate or free during a capture, announce it: call this after
///   `cuStreamBeginCapture` with the capturing stream. Allocations in that capture then
///   come from the private pool, make no driver call that invalidates the capture (calls are
///   made in relaxed capture mode; no event is recorded or queried on a capturing stream),
///   and never go to eager code, even once freed. Call `gpupool_end_allocate_to_pool`
///   after `cuStreamEndCapture`, and `gpupool_release_pool` once every graph captured
///   into the pool is destroyed. Captures may share a pool id when their graphs replay in
///   capture order (PyTorch's `pool=` rule).
/// - Unannounced allocations on a capturing stream may invalidate the capture.
/// - Capture on a non-blocking stream: in global capture mode the legacy default stream,
///   which other threads' pool work may use, must not be ordered with a capturing stream.
///
/// # Safety
/// No requirement beyond the C prototype.
#[no_mangle]
pub unsafe extern "C" fn gpupool_begin_allocate_to_pool(device: c_int, pool_id: u64, stream: *mut c_void) -> Status {
    call(|| {
        private_pools::begin_c_pool(device, pool_id, stream as usize)
    })
}

/// Stop routing allocations to `pool_id` (the latest `gpupool_begin_allocate_to_pool` for it).
#[no_mangle]
pub extern "C" fn gpupool_end_allocate_to_pool(device: c_int, pool_id: u64) -> Status {
    call(|| private_pools::end_c_pool(device, pool_id))
}

/// One user of `pool_id` is done (its graph was destroyed). When no use is left and none
/// of its blocks is live, its memory goes back to the driver after one device
/// synchronisation. Unknown ids succeed and do nothing.
#[no_mangle]
pub extern "C" fn gpupool_release_pool(device: c_int, pool_id: u64) -> Status {
    call(|| private_pools::release_c_pool(device, pool_id))
}

/// Release the memory kept for a capture nobody announced (CuPy's `Stream.begin_capture`
/// without `gpupool.cupy.capture`): `capture_id` is `cuStreamGetCaptureInfo`'s id.
#[no_mangle]
pub extern "C" fn gpupool_release_capture(device: c_int, capture_id: u64) -> Status {
    call(|| private_pools::release_capture(device, capture_id))
}
