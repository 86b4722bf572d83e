//! Tags and pausing (`docs/tags.md`): allocate under a tag, give a tag's device memory
//! back while its addresses stay reserved, and get it back at the same addresses.

use super::boundary::{call, call_value, opt_str, write_str};
use crate::error::{Error, Status};
use crate::front::tags;
use std::ffi::{c_char, c_int, c_void};

/// # Safety
/// `name` must be NULL (rejected) or a NUL-terminated string.
unsafe fn tag_name<'a>(name: *const c_char) -> crate::error::Result<&'a str> {
    opt_str(name, "tag")?.ok_or(Error::NullArgument("tag"))
}

/// # Safety
/// `out` must be NULL or writable.
unsafe fn put(out: *mut usize, v: usize) {
    if !out.is_null() {
        *out = v;
    }
}

/// From now on this thread's allocations (every device, every route: C, PyTorch, CuPy)
/// come from tag `name`'s own memory, until the matching `gpupool_tag_end`. Tags nest.
/// A private pool made meanwhile (`gpupool_begin_allocate_to_pool`, a PyTorch graph or
/// `MemPool`) lives in the tag's memory and pauses with it; one made outside every tag
/// serves what its route takes, outside the tag.
///
/// # Safety
/// `name` must be NULL (rejected) or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn gpupool_tag_begin(name: *const c_char) -> Status {
    call(|| tags::begin(tag_name(name)?))
}

/// Choose what tag `name`'s memory is made of (Note [A tag's memory]): `"pausable"` (the
/// default: virtual memory that `gpupool_tag_pause` gives back at kept addresses, sent as
/// PyTorch's expandable segments) or `"cuda-ipc"` (`cuMemAlloc` segments, sent as CUDA IPC
/// handles that any receiver opens in any container, even without ptrace rights; a pause of
/// the tag is refused). Call it before the tag's first allocation: `GPUPOOL_STATUS_BUSY`,
/// with nothing changed, while the tag holds memory on a device.
///
/// # Safety
/// `name` and `memory` must be NULL (rejected) or NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn gpupool_tag_place(name: *const c_char, memory: *const c_char) -> Status {
    call(|| {
        let name = tag_name(name)?;
        let memory = opt_str(memory, "memory")?.ok_or(Error::NullArgument("memory"))?;
        tags::place(name, memory)
    })
}

/// Writes every tag this process named, one a line (`name` TAB `memory` NEWLINE, memory
/// `pausable` or `cuda-ipc`), into `buf` as `snprintf` does (at most `len - 1` bytes and a
/// NUL; NULL or 0 writes nothing) and returns the length of the whole list: a pause of
/// everything pauses each pausable tag in it (Python's `gpupool.pause()` does).
///
/// # Safety
/// `buf` must be NULL or point to `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn gpupool_tag_names(buf: *mut c_char, len: usize) -> usize {
    call_value(0, || {
        write_str(&tags::names(), buf, len)
    })
}

/// End this thread's innermost `gpupool_tag_begin`.
#[no_mangle]
pub extern "C" fn gpupool_tag_end() -> Status {
    call(tags::end)
}

/// Pause tag `name` on `device` (-1: every device): wait for the work queued on `stream`
/// (NULL: the legacy stream) before copying, copy the tag's memory to page-locked host
/// memory if `backup` is non-zero, and give its device memory back to the driver; its
/// addresses stay reserved. Until `gpupool_tag_resume`, allocations under the tag are
/// refused, frees of its blocks wait for the resume and its blocks cannot be exported.
/// `*out_released` (optional) receives the device bytes given back.
/// `GPUPOOL_STATUS_BUSY`, with nothing paused, while another process has one of the tag's
/// blocks open that it imported through gpupool (the error names the blocks and the
/// processes). Receivers that keep closed imports mapped drop them when asked: the pause
/// waits for them (at most 2 s) before it returns.
///
/// # Safety
/// `name` must be NULL (rejected) or a NUL-terminated string; `out_released` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gpupool_tag_pause(device: c_int, name: *const c_char, stream: *mut c_void, backup: c_int, out_released: *mut usize) -> Status {
    call(|| {
        let n = tags::pause(device, tag_name(name)?, stream as usize, backup != 0)?;
        put(out_released, n);
        Ok(())
    })
}

/// Resume tag `name` on `device` (-1: every device): new device memory at the same
/// addresses, the backup copied back. Out of memory leaves it paused (resume again later).
/// `*out_restored` (optional) receives the bytes mapped again.
///
/// # Safety
/// `name` must be NULL (rejected) or a NUL-terminated string; `out_restored` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gpupool_tag_resume(device: c_int, name: *const c_char, out_restored: *mut usize) -> Status {
    call(|| {
        let n = tags::resume(device, tag_name(name)?)?;
        put(out_restored, n);
        Ok(())
    })
}

/// `*out_bytes` receives the device bytes tag `name` has paused on `device` (-1: every device).
///
/// # Safety
/// `name` must be NULL (rejected) or a NUL-terminated string; `out_bytes` NULL (rejected) or writable.
#[no_mangle]
pub unsafe extern "C" fn gpupool_tag_paused_bytes(device: c_int, name: *const c_char, out_bytes: *mut usize) -> Status {
    call(|| {
        if out_bytes.is_null() {
            return Err(Error::NullArgument("out_bytes"));
        }
        *out_bytes = tags::paused_bytes(device, tag_name(name)?)?;
        Ok(())
    })
}

/// Give back the page-locked host memory kept for tag `name`'s next backup on `device`
/// (-1: every device); a paused tag's backup stays. `*out_bytes` (optional) receives its size.
///
/// # Safety
/// `name` must be NULL (rejected) or a NUL-terminated string; `out_bytes` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gpupool_tag_drop_backup(device: c_int, name: *const c_char, out_bytes: *mut usize) -> Status {
    call(|| {
        let n = tags::drop_backup(device, tag_name(name)?)?;
        put(out_bytes, n);
        Ok(())
    })
}

/// Page-lock now the host memory tag `name`'s next pause with a backup copies into on
/// `device` (-1: every device), as large as the tag's memory is now: the first pause then
/// copies at once instead of page-locking first (seconds for gigabytes). It is kept as
/// after a pause, until `gpupool_tag_drop_backup`; a tag that grew afterwards gets a larger
/// buffer at its next pause. Allocations under the tag wait while it runs. `*out_bytes`
/// (optional) receives the buffer's size.
///
/// # Safety
/// `name` must be NULL (rejected) or a NUL-terminated string; `out_bytes` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gpupool_tag_prepare_backup(device: c_int, name: *const c_char, out_bytes: *mut usize) -> Status {
    call(|| {
        let n = tags::prepare_backup(device, tag_name(name)?)?;
        put(out_bytes, n);
        Ok(())
    })
}
