//! The pinned (page-locked host) pool: one per process, CuPy's `PinnedMemoryPool` for C.

use crate::error::{Error, Result};
use crate::registry;
use crate::stats::Stats;

pub fn malloc(size: usize, stream: usize) -> Result<usize> {
    registry::with_pinned(|p| p.malloc(size, stream))
}

pub fn free(ptr: usize, stream: usize) -> Result<()> {
    registry::with_pinned(|p| p.free(ptr, stream)).map_err(|e| match e {
        // The pinned pool is no device's.
        Error::InvalidPointer { ptr, why, .. } => Error::InvalidPointer { ptr, device: -1, why },
        other => other,
    })
}

pub fn stats() -> Result<Stats> {
    registry::with_pinned(|p| Ok(p.stats()))
}

/// Return its free cached memory to the driver; the bytes released.
pub fn reclaim() -> Result<usize> {
    registry::with_pinned(|p| p.reclaim())
}
