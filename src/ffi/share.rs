//! What the frameworks' process-sharing routes (`gpupool.torch`'s `torch.multiprocessing`
//! reductions, `gpupool.cupy.share`) need beyond `ipc.rs`: holds that tell an exporter
//! when its importers let go (`crate::share::holds`), and an import
//! (`crate::share::received`) handed out as a DLPack tensor whose deleter closes it.

use super::boundary::call;
use super::ipc::read_descriptor;
use crate::error::Error;
use crate::share::holds;
use crate::share::received::Received;
use std::ffi::{c_char, c_int, c_void};

/// Take a hold for one send of a block to another process: `*out_fd` receives this
/// process's holds file descriptor (send a copy of it with the block's; it stays open
/// until the process ends: do not close it) and `*out_slot` the send's slot, held until
/// the importer releases it (`gpupool_ipc_open_dlpack`, `gpupool_share_release`). Keep the
/// block allocated until `gpupool_share_held` says it was released.
///
/// # Safety
/// `out_fd` and `out_slot` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gpupool_share_hold(out_fd: *mut c_int, out_slot: *mut u32) -> crate::error::Status {
    call(|| {
        crate::fork::refuse_in_child()?;
        if out_fd.is_null() || out_slot.is_null() {
            return Err(Error::NullArgument(if out_fd.is_null() { "out_fd" } else { "out_slot" }));
        }
        let (fd, slot) = holds::hold()?;
        *out_fd = fd;
        *out_slot = slot;
        Ok(())
    })
}

/// Whether the importer of `slot` (`gpupool_share_hold`) still holds it: `*out_held` 1, or
/// 0 once it let go, after which the slot may serve another send (do not ask again).
///
/// # Safety
/// `out_held` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gpupool_share_held(slot: u32, out_held: *mut c_int) -> crate::error::Status {
    call(|| {
        crate::fork::refuse_in_child()?;
        if out_held.is_null() {
            return Err(Error::NullArgument("out_held"));
        }
        *out_held = c_int::from(holds::held(slot)?);
        Ok(())
    })
}

/// How many sends of this process other processes still hold (as last asked with
/// `gpupool_share_held`).
#[no_mangle]
pub extern "C" fn gpupool_share_held_count() -> usize {
    // A fork child answers 0 without the holds lock a parent thread may have held.
    super::boundary::call_value(0, || if crate::process::in_child() { 0 } else { holds::held_count() })
}

/// Release hold `slot` of the exporter whose holds file is `holds_fd` (this process's copy,
/// which stays the caller's): the exporter may free the block. For a send this process
/// did not open (it already had the block open from an earlier send).
#[no_mangle]
pub extern "C" fn gpupool_share_release(holds_fd: c_int, slot: u32) -> crate::error::Status {
    call(|| {
        crate::fork::refuse_in_child()?;
        holds::release(holds::map_theirs(holds_fd)?, slot)
    })
}

/// DLPack's `DLDevice`, `DLDataType`, `DLTensor` and `DLManagedTensor` (the unversioned
/// ABI every framework's `from_dlpack` accepts in a capsule named "dltensor").
#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
pub(super) struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

const DL_CPU: i32 = 1;
const DL_CUDA: i32 = 2;
const DL_UINT: u8 = 1;

/// A DLPack tensor over an import. `managed` comes first, so the pointer handed out is
/// also this struct's.
#[repr(C)]
struct Imported {
    managed: DlManagedTensor,
    shape: i64,
    received: Received,
}

/// Map the block another process exported (`desc`, as `gpupool_ipc_open`, the descriptors
/// `fds` passed in, which stay the caller's) and hand it out as `*out_tensor`: a
/// `DLManagedTensor*` of `size` bytes (1-D, uint8) on `device` (CPU memory on the host
/// upstream). Its deleter, which the framework calls when the last tensor over it is gone,
/// closes the import and releases the exporter's hold `slot` in the holds file `holds_fd`
/// (this process's copy, which stays the caller's; -1: no hold). Wrap it in a capsule named
/// "dltensor" for `from_dlpack`.
///
/// # Safety
/// `desc`: `desc_len` readable bytes; `fds`: `n_fds` readable ints; `out_tensor` writable.
#[no_mangle]
pub unsafe extern "C" fn gpupool_ipc_open_dlpack(
    desc: *const c_void,
    desc_len: usize,
    device: c_int,
    fds: *const c_int,
    n_fds: usize,
    holds_fd: c_int,
    slot: u32,
    out_tensor: *mut *mut c_void,
) -> crate::error::Status {
    call(|| {
        crate::fork::refuse_in_child()?;
        if out_tensor.is_null() {
            return Err(Error::NullArgument("out_tensor"));
        }
        *out_tensor = std::ptr::null_mut();
        if fds.is_null() && n_fds > 0 {
            return Err(Error::NullArgument("fds"));
        }
        let d = read_descriptor(desc, desc_len)?;
        let given: &[c_int] = if n_fds == 0 { &[] } else { std::slice::from_raw_parts(fds, n_fds) };
        *out_tensor = dlpack(Received::open(&d, device, given, holds_fd, slot)?).cast();
        Ok(())
    })
}

/// `received` as a DLPack tensor whose deleter closes it.
pub(super) fn dlpack(received: Received) -> *mut DlManagedTensor {
    let (on_host, device) = (received.on_host, received.device);
    let t = Box::into_raw(Box::new(Imported {
        managed: DlManagedTensor {
            dl_tensor: DlTensor {
                data: received.ptr as *mut c_void,
                device: DlDevice { device_type: if on_host { DL_CPU } else { DL_CUDA }, device_id: if on_host { 0 } else { device } },
                ndim: 1,
                dtype: DlDataType { code: DL_UINT, bits: 8, lanes: 1 },
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_imported),
        },
        // `Received::open` keeps sizes within i64.
        shape: received.size as i64,
        received,
    }));
    // SAFETY: just made; the shape lives in the same box.
    unsafe { (*t).managed.dl_tensor.shape = &mut (*t).shape };
    t.cast()
}

/// The deleter of `gpupool_ipc_open_dlpack`'s tensors: close the import (`Received::close`),
/// free the tensor. Errors cannot be returned from here: they are warned about.
unsafe extern "C" fn delete_imported(t: *mut DlManagedTensor) {
    if t.is_null() {
        return;
    }
    let t = Box::from_raw(t.cast::<Imported>());
    let (ptr, device) = (t.received.ptr, t.received.device);
    super::boundary::call_value((), || {
        if let Err(f) = t.received.close() {
            crate::error::warn(&format!(
                "gpupool: warning: closing the import at {ptr:#x} on device {device} when its last tensor went failed: {}; \
                 its exporter's {} hold(s) stay held, so that process does not reuse memory this one may still write",
                f.error, f.holds_kept
            ));
        }
    });
}

/// Make `tensor` (a `DLManagedTensor*` from `gpupool_ipc_open_dlpack`, not yet deleted)
/// give a sender's count back once its deleter has closed the import (which waits for the
/// work this process queued on the device): the 64-bit count at `byte_offset` in the POSIX
/// shared-memory object `name` (`name_len` bytes, as `shm_open` takes it) goes down by one.
/// Where the object is gone (its sender ended) nothing happens. PyTorch's own CUDA IPC route
/// counts its sends so (`CudaIPCSentData`): its sender frees a block once the count is 0.
/// Replaces any count given before.
///
/// # Safety
/// `tensor` must be such a tensor; `name`: `name_len` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn gpupool_dlpack_give_back_count(
    tensor: *mut c_void,
    name: *const c_char,
    name_len: usize,
    byte_offset: u64,
) -> crate::error::Status {
    call(|| {
        crate::fork::refuse_in_child()?;
        if tensor.is_null() {
            return Err(Error::NullArgument("tensor"));
        }
        if name.is_null() {
            return Err(Error::NullArgument("name"));
        }
        let name = std::slice::from_raw_parts(name.cast::<u8>(), name_len);
        if name.is_empty() || name.contains(&0) || byte_offset % 8 != 0 {
            return Err(Error::InvalidArgument(format!(
                "a shared count needs a name without NUL bytes and an offset that is a multiple of 8 (got {} bytes, offset {byte_offset})",
                name.len()
            )));
        }
        (*tensor.cast::<Imported>()).received.give_back_count_at_close(name.to_vec(), byte_offset);
        Ok(())
    })
}
