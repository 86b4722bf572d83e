//! Private pools (Note [Graph pools]): routing a device's allocations to one while a CUDA
//! graph is captured or a `MemPool` is in use, and the pools' lives. C programs name a
//! pool by a 64-bit id, PyTorch by its `MempoolId_t` pair; CuPy's unannounced captures by
//! the capture's id.

use crate::error::{Error, Result};
use crate::pool::{Filter, PoolId, C_POOL_TAG, IMPLICIT_POOL_TAG};
use crate::registry;

pub use crate::pool::Callback;

/// Route `device`'s allocations to C pool `pool_id`: those of the capture `stream` is in,
/// or, if it is not capturing, those on `stream`.
pub fn begin_c_pool(device: i32, pool_id: u64, stream: usize) -> Result<()> {
    registry::begin_route(device, (pool_id, C_POOL_TAG), |p| {
        Ok(match p.capture_of(stream)? {
            Some(cid) => Filter::Capture(cid),
            None => Filter::Stream(p.stream_key(stream)?),
        })
    })
}

/// Stop routing to C pool `pool_id`.
pub fn end_c_pool(device: i32, pool_id: u64) -> Result<()> {
    registry::end_route(device, (pool_id, C_POOL_TAG))
}

/// One user of C pool `pool_id` is done.
pub fn release_c_pool(device: i32, pool_id: u64) -> Result<()> {
    registry::release_private_pool(device, (pool_id, C_POOL_TAG)).map(|_| ())
}

/// Release the memory kept for the unannounced capture `capture_id`.
pub fn release_capture(device: i32, capture_id: u64) -> Result<()> {
    if capture_id == 0 {
        return Err(Error::InvalidArgument("capture id 0 names no capture".into()));
    }
    registry::release_private_pool(device, (capture_id, IMPLICIT_POOL_TAG)).map(|_| ())
}

/// Route `device`'s allocations that `filter` accepts to pool `id` (PyTorch's
/// `beginAllocateToPool`).
pub fn begin_filtered(device: i32, id: PoolId, filter: Callback) -> Result<()> {
    registry::begin_route(device, id, |_| Ok(Filter::Callback(filter)))
}

/// Stop the latest route to pool `id`.
pub fn end(device: i32, id: PoolId) -> Result<()> {
    registry::end_route(device, id)
}

/// One use of pool `id` ends.
pub fn release(device: i32, id: PoolId) -> Result<()> {
    registry::release_private_pool(device, id).map(|_| ())
}

/// One more use of pool `id`, made if new (`torch.cuda.MemPool`).
pub fn create(device: i32, id: PoolId) -> Result<()> {
    registry::create_private_pool(device, id)
}

/// The uses of pool `id` (0: none such).
pub fn uses(device: i32, id: PoolId) -> Result<i64> {
    registry::private_pool_uses(device, id)
}

/// Give pool `id`'s memory back if nothing uses it; the bytes released.
pub fn empty(device: i32, id: PoolId) -> Result<usize> {
    registry::empty_private_pool(device, id)
}
