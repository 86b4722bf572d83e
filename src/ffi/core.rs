//! The public C API. Names and signatures here are the contract in `include/gpupool.h`.
//!
//! Conventions: every function returning `gpupool_status` leaves the pool unchanged on
//! failure and keeps a detailed message for `gpupool_last_error` on the calling thread.
//! Streams are `CUstream` / `cudaStream_t` values passed as `void *` (NULL = legacy default).

use super::boundary::{call, call_value, last_error, opt_str, write_str};
use crate::error::{Error, Status};
use crate::front::{self, device};
use crate::stats::{stats_version_of, Stats, STATS_V1_SIZE};
use std::ffi::{c_char, c_int, c_void};

/// Copy `s` into the caller's struct honouring its `struct_size` (0 = version 1's size).
///
/// # Safety
/// `out` must point to at least `out->struct_size` (or `STATS_V1_SIZE`) writable bytes.
pub(crate) unsafe fn write_stats(mut s: Stats, out: *mut Stats) {
    let want = match (*out).struct_size as usize {
        0 => STATS_V1_SIZE,
        n => n,
    };
    let n = want.min(std::mem::size_of::<Stats>());
    s.struct_size = n as u32;
    s.version = stats_version_of(n);
    std::ptr::copy_nonoverlapping(&s as *const Stats as *const u8, out as *mut u8, n);
}

/// Allocate `size` bytes on `device` for use on `stream`.
///
/// `*out_ptr` receives the address (aligned to at least 256 bytes), or NULL on failure.
/// `size == 0` succeeds with `*out_ptr == NULL`.
///
/// # Safety
/// `out_ptr` must be NULL (rejected) or writable.
#[no_mangle]
pub unsafe extern "C" fn gpupool_malloc(out_ptr: *mut *mut c_void, size: usize, device: c_int, stream: *mut c_void) -> Status {
    call(|| {
        if out_ptr.is_null() {
            return Err(Error::NullArgument("out_ptr"));
        }
        *out_ptr = std::ptr::null_mut();
        *out_ptr = front::malloc(device, size, stream as usize)? as *mut c_void;
        Ok(())
    })
}

/// Free `ptr` (from `gpupool_malloc` on `device`), whose last use was on `stream`.
/// Freeing NULL is a no-op. Unknown, interior and already-freed pointers are rejected with
/// `GPUPOOL_STATUS_INVALID_POINTER` and counted; nothing else changes.
///
/// # Safety
/// No requirement beyond the C prototype: the pointer is only looked up, never dereferenced.
#[no_mangle]
pub unsafe extern "C" fn gpupool_free(ptr: *mut c_void, device: c_int, stream: *mut c_void) -> Status {
    call(|| front::free(ptr as usize, device, stream as usize))
}

/// Fill `*out` with `device`'s statistics. Set `out->struct_size = sizeof(gpupool_stats)`
/// first (0 means the version-1 layout); at most that many bytes are written.
///
/// # Safety
/// `out` must be NULL (rejected) or point to a writable `gpupool_stats`.
#[no_mangle]
pub unsafe extern "C" fn gpupool_get_stats(device: c_int, out: *mut Stats) -> Status {
    call(|| {
        if out.is_null() {
            return Err(Error::NullArgument("out"));
        }
        let s = device::stats(device)?;
        write_stats(s, out);
        Ok(())
    })
}

/// Start `device`'s peaks (`peak_used_bytes`, `peak_total_bytes`, `peak_requested_bytes`)
/// again from what is in use and reserved now, as PyTorch's `reset_peak_memory_stats`.
/// A device whose pool is not made yet has nothing to reset.
#[no_mangle]
pub extern "C" fn gpupool_reset_peak_stats(device: c_int) -> Status {
    call(|| device::reset_peaks(device))
}

/// Let device `peer` read and write the memory gpupool maps on device `device`, what is
/// mapped now and everything mapped from now on. Arena memory is granted to its own device
/// and to the peers enabled so (PyTorch's allocator class calls this from its
/// `enablePeerAccess` hook, before PyTorch's first peer copy); C and CuPy programs that read
/// one device's memory from another call it first (after `cudaDeviceEnablePeerAccess`).
/// -1 for either: every device, every peer that can (what the allocator grants without
/// being asked, PyTorch's plug-in route uses it). `*out_grants` (optional) receives the
/// access grants made now. `GPUPOOL_STATUS_INVALID_DEVICE` for a bad id;
/// `GPUPOOL_STATUS_INVALID_ARGUMENT` where `peer` cannot access `device`.
///
/// # Safety
/// `out_grants` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gpupool_enable_peer_access(device: c_int, peer: c_int, out_grants: *mut usize) -> Status {
    call(|| {
        let n = device::enable_peer_access(device, peer)?;
        if !out_grants.is_null() {
            *out_grants = n;
        }
        Ok(())
    })
}

/// Return every wholly free cached segment of `device` (-1: all devices) to the upstream.
/// `*out_released` (optional) receives the bytes released.
///
/// # Safety
/// `out_released` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gpupool_reclaim(device: c_int, out_released: *mut usize) -> Status {
    call(|| {
        let (total, first_err) = device::reclaim(device)?;
        if !out_released.is_null() {
            *out_released = total;
        }
        first_err.map_or(Ok(()), Err)
    })
}

/// Cap `device`'s reserved bytes at `bytes` (0 = no limit); cached memory above the cap is
/// released at once. Overrides `GPUPOOL_MEMORY_LIMIT` for that device.
#[no_mangle]
pub extern "C" fn gpupool_set_limit(device: c_int, bytes: usize) -> Status {
    call(|| device::set_limit(device, bytes))
}

/// The same as `gpupool_set_limit` with the limit written as `GPUPOOL_MEMORY_LIMIT` accepts
/// it: bytes, a size with unit (`"8GiB"`, `"512MB"`) or a percentage of the device (`"50%"`);
/// `"0"` removes the limit.
///
/// # Safety
/// `limit` must be NULL (rejected) or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn gpupool_set_limit_str(device: c_int, limit: *const c_char) -> Status {
    call(|| {
        let text = opt_str(limit, "limit")?.ok_or(Error::NullArgument("limit"))?;
        device::set_limit_text(device, text)
    })
}

/// `*out_bytes` receives `device`'s limit (0 = none).
///
/// # Safety
/// `out_bytes` must be NULL (rejected) or writable.
#[no_mangle]
pub unsafe extern "C" fn gpupool_get_limit(device: c_int, out_bytes: *mut usize) -> Status {
    call(|| {
        if out_bytes.is_null() {
            return Err(Error::NullArgument("out_bytes"));
        }
        *out_bytes = device::limit(device)?;
        Ok(())
    })
}

/// A report and the error behind it, if any (recorded as this thread's last error).
fn reported((text, error): (String, Option<crate::error::Error>)) -> String {
    if let Some(e) = &error {
        super::boundary::record(e);
    }
    text
}

/// Human-readable report of `device` (-1: every device in use), like CUDA.jl's
/// `memory_status()`. snprintf convention: writes at most `len` bytes including the NUL
/// and returns the report's length (allocate return + 1 bytes for all of it). Where no
/// pool is in use because the environment's configuration is malformed (or the trace file
/// it names cannot be opened), the report is that error (also `gpupool_last_error`'s).
///
/// # Safety
/// `buf` must be NULL or point to `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn gpupool_memory_status(device: c_int, buf: *mut c_char, len: usize) -> usize {
    call_value(0, || {
        write_str(&reported(device::memory_status(device)), buf, len)
    })
}

/// Where process `pid` (0: this process) answers status requests when it runs with
/// `GPUPOOL_STATUS_SOCKET=1`, for a reader of the same user (Note [The status socket]).
/// snprintf convention, as `gpupool_memory_status`. A reader should check that the peer's
/// credentials (`SO_PEERCRED`) are `pid`'s and its own user's before trusting the answer.
///
/// # Safety
/// `buf` must be NULL or point to `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn gpupool_status_socket_path(pid: c_int, buf: *mut c_char, len: usize) -> usize {
    call_value(0, || {
        let pid = if pid <= 0 { std::process::id() } else { pid as u32 };
        write_str(&device::status_socket_path(pid).to_string_lossy(), buf, len)
    })
}

/// The same numbers as JSON: one object for a device, an array for -1. Same buffer
/// convention as `gpupool_memory_status`. Beyond the `gpupool_stats` fields each object
/// has `driver_calls` (calls made by kind, and `total`), `arena` for arena pools (mapped
/// bytes, address space, granules mapped/unmapped, stitches) and `notice` when the
/// configured strategy could not run (arena without virtual memory management).
///
/// # Safety
/// `buf` must be NULL or point to `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn gpupool_stats_json(device: c_int, buf: *mut c_char, len: usize) -> usize {
    call_value(0, || {
        write_str(&reported(device::stats_json(device)), buf, len)
    })
}

/// The device's memory as segments cut into blocks (allocated, pending free, free), as JSON
/// (one object for a device, an array for -1; same buffer convention as
/// `gpupool_memory_status`). `gpupool.snapshot.snapshot()` turns it into PyTorch's memory snapshot
/// format for `torch.cuda._memory_viz` and PyTorch's memory visualizer.
///
/// # Safety
/// `buf` must be NULL or point to `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn gpupool_snapshot_json(device: c_int, buf: *mut c_char, len: usize) -> usize {
    call_value(0, || {
        write_str(&reported(device::snapshot_json(device)), buf, len)
    })
}

/// Constant description of a status code (never NULL).
#[no_mangle]
pub extern "C" fn gpupool_status_str(status: c_int) -> *const c_char {
    match Status::ALL.get(status as usize) {
        Some(s) if status >= 0 => s.describe().as_ptr(),
        _ => c"unknown gpupool status".as_ptr(),
    }
}

/// This thread's last detailed error message (snprintf convention, see
/// `gpupool_memory_status`). Not cleared by later successful calls.
///
/// # Safety
/// `buf` must be NULL or point to `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn gpupool_last_error(buf: *mut c_char, len: usize) -> usize {
    call_value(0, || write_str(&last_error(), buf, len))
}

/// Choose `device`'s strategy (`"split"`, `"binned"`, `"none"`, `"arena"`) and/or upstream
/// (`"device"`, `"vmm"`, `"managed"`, `"async"`, `"host"`) at run time; NULL keeps the current one.
/// Allowed while the device has no live allocations (else `GPUPOOL_STATUS_BUSY`).
///
/// # Safety
/// `pool` and `upstream` must be NULL or NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn gpupool_configure(device: c_int, pool: *const c_char, upstream: *const c_char) -> Status {
    call(|| {
        device::configure(device, opt_str(pool, "pool")?, opt_str(upstream, "upstream")?)
    })
}

/// Mark that `stream`'s work uses `ptr` (a live block): its free will also wait for the
/// work queued on `stream` until the free, before the block can be reused.
///
/// # Safety
/// No requirement beyond the C prototype.
#[no_mangle]
pub unsafe extern "C" fn gpupool_record_stream(ptr: *mut c_void, stream: *mut c_void) -> Status {
    call(|| device::record_stream(ptr as usize, stream as usize))
}

/// `*out_count` receives the number of CUDA devices; `GPUPOOL_STATUS_NO_DRIVER` when
/// libcuda cannot be loaded (the host upstream still works).
///
/// # Safety
/// `out_count` must be NULL (rejected) or writable.
#[no_mangle]
pub unsafe extern "C" fn gpupool_device_count(out_count: *mut c_int) -> Status {
    call(|| {
        if out_count.is_null() {
            return Err(Error::NullArgument("out_count"));
        }
        *out_count = device::device_count()?;
        Ok(())
    })
}

/// The library version, e.g. `"0.1.0"`.
#[no_mangle]
pub extern "C" fn gpupool_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr() as *const c_char
}

/// The leak report: every live allocation of every device, largest first. With
/// `GPUPOOL_DEBUG=2` each entry carries the age, stream and symbolised backtrace of its
/// allocation. Same buffer convention as `gpupool_memory_status`.
///
/// # Safety
/// `buf` must be NULL or point to `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn gpupool_report_leaks(buf: *mut c_char, len: usize) -> usize {
    call_value(0, || write_str(&device::leak_report(), buf, len))
}
