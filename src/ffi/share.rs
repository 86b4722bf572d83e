//! What the frameworks' process-sharing routes (`gpupool.torch`'s `torch.multiprocessing`
//! reductions, `gpupool.cupy.share`) need beyond `ipc.rs`: holds that tell an exporter
//! when its importers let go (`crate::holds`), and an import handed out as a DLPack tensor
//! whose deleter closes it and releases the hold, so the framework's own tensor lifetime
//! decides when the mapping goes, with no Python code in the deleter (it may run late in
//! the interpreter's life, or on a thread without the GIL). Imports are shared between the
//! blocks held in them, and grown in place, by `share/spans.rs`.

mod spans;

use super::boundary::call;
use super::ipc::{read_descriptor, AnyDescriptor};
use spans::{Hold, SpanUse};
use crate::error::Error;
use crate::holds;
use crate::registry;
use std::ffi::{c_int, c_void};

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
    super::boundary::call_value(0, holds::held_count)
}

/// Release hold `slot` of the exporter whose holds file is `holds_fd` (this process's copy,
/// which stays the caller's): the exporter may free the block. For a send this process
/// did not open (it already had the block open from an earlier send).
#[no_mangle]
pub extern "C" fn gpupool_share_release(holds_fd: c_int, slot: u32) -> crate::error::Status {
    call(|| holds::release(holds::map_theirs(holds_fd)?, slot))
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
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

const DL_CPU: i32 = 1;
const DL_CUDA: i32 = 2;
const DL_UINT: u8 = 1;

/// A DLPack tensor over an import, with what its deleter undoes. `managed` comes first, so
/// the pointer handed out is also this struct's.
#[repr(C)]
struct Imported {
    managed: DlManagedTensor,
    shape: i64,
    ptr: usize,
    device: i32,
    hold: Option<Hold>,
    /// The span it is mapped through, shared with other blocks in it (`spans::open_shared`).
    shared: Option<SpanUse>,
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
        if out_tensor.is_null() {
            return Err(Error::NullArgument("out_tensor"));
        }
        *out_tensor = std::ptr::null_mut();
        if fds.is_null() && n_fds > 0 {
            return Err(Error::NullArgument("fds"));
        }
        let d = read_descriptor(desc, desc_len)?;
        // The holds file first: an import that cannot release its hold later must not be made.
        let hold = if holds_fd >= 0 { Some((holds::map_theirs(holds_fd)?, slot)) } else { None };
        let given: &[c_int] = if n_fds == 0 { &[] } else { std::slice::from_raw_parts(fds, n_fds) };
        let on_host = registry::with_pool(device, |pool| Ok(pool.upstream_name() == "host"))?;
        let size = i64::try_from(d.size()).map_err(|_| Error::InvalidArgument("IPC import: size out of range".into()))?;
        // Last: nothing after it may fail, or the import (or its share of a span) would stay.
        let (ptr, shared) = match &d {
            AnyDescriptor::Arena(a) => spans::open_shared(a, device, given, hold.is_some()).map(|(p, u)| (p, Some(u)))?,
            AnyDescriptor::Segment(_) => (d.open(device, Some(given))?, None),
        };
        let t = Box::into_raw(Box::new(Imported {
            managed: DlManagedTensor {
                dl_tensor: DlTensor {
                    data: ptr as *mut c_void,
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
            shape: size,
            ptr,
            device,
            hold,
            shared,
        }));
        (*t).managed.dl_tensor.shape = &mut (*t).shape;
        *out_tensor = t.cast();
        Ok(())
    })
}

/// The deleter of `gpupool_ipc_open_dlpack`'s tensors: close the import, release the hold,
/// free the tensor. Errors cannot be returned from here: they are warned about.
unsafe extern "C" fn delete_imported(t: *mut DlManagedTensor) {
    if t.is_null() {
        return;
    }
    let t = Box::from_raw(t.cast::<Imported>());
    let (close, holds) = match t.shared {
        Some(key) => spans::unshare(key, t.hold),
        None => (vec![t.ptr], t.hold.into_iter().collect()),
    };
    for ptr in close {
        if call(|| registry::with_pool(t.device, |pool| pool.ipc_close(ptr))) != crate::error::Status::Ok {
            crate::error::warn(&format!(
                "gpupool: warning: closing the import at {ptr:#x} on device {} when its last tensor went failed: {}",
                t.device,
                super::boundary::last_error()
            ));
        }
    }
    for (id, slot) in holds {
        let _ = call(|| holds::release(id, slot));
    }
}
