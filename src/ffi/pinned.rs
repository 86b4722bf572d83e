//! The pinned (page-locked host) pool's C functions, CuPy's `PinnedMemoryPool` for C.
//! One pool per process; the stream rules match the device pools (events live in device
//! 0's primary context, so streams passed here must belong to device 0).

use super::boundary::call;
use super::core::write_stats;
use crate::error::{Error, Status};
use crate::front::pinned;
use crate::stats::Stats;
use std::ffi::c_void;

/// Allocate `size` bytes of pinned host memory, for use on `stream`.
///
/// # Safety
/// `out_ptr` must be NULL (rejected) or writable.
#[no_mangle]
pub unsafe extern "C" fn gpupool_pinned_malloc(out_ptr: *mut *mut c_void, size: usize, stream: *mut c_void) -> Status {
    call(|| {
        if out_ptr.is_null() {
            return Err(Error::NullArgument("out_ptr"));
        }
        *out_ptr = std::ptr::null_mut();
        *out_ptr = pinned::malloc(size, stream as usize)? as *mut c_void;
        Ok(())
    })
}

/// Free pinned memory whose last use (e.g. an async copy) was on `stream`.
///
/// # Safety
/// No requirement beyond the C prototype.
#[no_mangle]
pub unsafe extern "C" fn gpupool_pinned_free(ptr: *mut c_void, stream: *mut c_void) -> Status {
    call(|| {
        pinned::free(ptr as usize, stream as usize)
    })
}

/// Statistics of the pinned pool (same struct and `struct_size` rule as `gpupool_get_stats`).
///
/// # Safety
/// `out` must be NULL (rejected) or point to a writable `gpupool_stats`.
#[no_mangle]
pub unsafe extern "C" fn gpupool_pinned_get_stats(out: *mut Stats) -> Status {
    call(|| {
        if out.is_null() {
            return Err(Error::NullArgument("out"));
        }
        write_stats(pinned::stats()?, out);
        Ok(())
    })
}

/// Return the pinned pool's free cached memory to the driver.
///
/// # Safety
/// `out_released` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gpupool_pinned_reclaim(out_released: *mut usize) -> Status {
    call(|| {
        let n = pinned::reclaim()?;
        if !out_released.is_null() {
            *out_released = n;
        }
        Ok(())
    })
}

