//! Sharing gpupool blocks with other processes: export a block as a byte descriptor, open
//! it in another process, close it there. Arena blocks (whose memory `cudaIpcGetMemHandle`
//! refuses) go as their granules' shareable handles (`crate::share::protocol` gives the
//! descriptor and how the file descriptors behind it travel); blocks of the segment pools
//! as CUDA's own IPC handle of their segment (`crate::share::protocol::segment_descriptor`).

use super::boundary::call;
use crate::error::{Error, Status};
use crate::share::descriptor::{self, AnyDescriptor};
use crate::share::torch_format;
use std::ffi::{c_int, c_void};

/// Read the descriptor at `desc` (`len` bytes), refusing a length no descriptor has
/// before touching the memory, so a wrong length is an error, not a read past the buffer
/// of a size that cannot exist.
pub(super) unsafe fn read_descriptor(desc: *const c_void, len: usize) -> crate::error::Result<AnyDescriptor> {
    if desc.is_null() {
        return Err(Error::NullArgument("desc"));
    }
    if len > descriptor::MAX_BYTES {
        return Err(Error::InvalidArgument(format!("IPC descriptor: {len} bytes is longer than any descriptor")));
    }
    AnyDescriptor::decode(std::slice::from_raw_parts(desc as *const u8, len))
}

/// Copy `bytes` to `buf` (`cap` bytes) and its length to `*out_len`. `buf == NULL` with
/// `cap == 0` only asks the length.
unsafe fn hand_out(bytes: &[u8], buf: *mut c_void, cap: usize, out_len: *mut usize, what: &str) -> crate::error::Result<()> {
    *out_len = bytes.len();
    if buf.is_null() && cap == 0 {
        return Ok(());
    }
    if buf.is_null() {
        return Err(Error::NullArgument("buf"));
    }
    if cap < bytes.len() {
        return Err(Error::InvalidArgument(format!("{what} needs {} bytes, the buffer has {cap}", bytes.len())));
    }
    std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf as *mut u8, bytes.len());
    Ok(())
}

/// The IPC descriptor of the live block `ptr` (as `gpupool_malloc` returned it), for
/// another process to open with `gpupool_ipc_open`: an arena block's granules, or a segment
/// pool's (`split`, ...) segment handle (`cuIpcGetMemHandle`) and offset. The descriptor is
/// plain bytes: send it any way. `*out_len` receives its length; with `buf == NULL` and
/// `buf_len == 0` nothing else happens (ask the size first), a smaller buffer is
/// `GPUPOOL_STATUS_INVALID_ARGUMENT`. Keep the block allocated while others use it.
///
/// # Safety
/// `buf` must be NULL or point to `buf_len` writable bytes; `out_len` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gpupool_ipc_export(ptr: *mut c_void, buf: *mut c_void, buf_len: usize, out_len: *mut usize) -> Status {
    call(|| export(ptr, false, buf, buf_len, out_len))
}

/// `gpupool_ipc_export` with `flags`: `GPUPOOL_IPC_SHARE_GRANULES` exports a block that
/// shares a granule with other live blocks too (every small block does); the importer can
/// then reach those blocks, as CUDA's own IPC shows the whole `cuMemAlloc` allocation and
/// PyTorch's the whole segment. Without it, such a block is refused. Unknown flag bits are
/// `GPUPOOL_STATUS_INVALID_ARGUMENT`.
///
/// # Safety
/// As `gpupool_ipc_export`.
#[no_mangle]
pub unsafe extern "C" fn gpupool_ipc_export_flags(ptr: *mut c_void, flags: u32, buf: *mut c_void, buf_len: usize, out_len: *mut usize) -> Status {
    call(|| {
        if flags & !GPUPOOL_IPC_SHARE_GRANULES != 0 {
            return Err(Error::InvalidArgument(format!("IPC export: unknown flags {flags:#x}")));
        }
        export(ptr, flags & GPUPOOL_IPC_SHARE_GRANULES != 0, buf, buf_len, out_len)
    })
}

/// `gpupool_ipc_export_flags`: export blocks that share granules with other live blocks.
pub const GPUPOOL_IPC_SHARE_GRANULES: u32 = 1;

unsafe fn export(ptr: *mut c_void, share_granules: bool, buf: *mut c_void, buf_len: usize, out_len: *mut usize) -> crate::error::Result<()> {
    if out_len.is_null() {
        return Err(Error::NullArgument("out_len"));
    }
    if ptr.is_null() {
        return Err(Error::NullArgument("ptr"));
    }
    let p = ptr as usize;
    if buf.is_null() && buf_len == 0 {
        *out_len = crate::share::export::export_len(p)?;
        return Ok(());
    }
    hand_out(&crate::share::export::export(p, share_granules)?, buf, buf_len, out_len, "the IPC descriptor")
}

/// The exporter's file descriptor numbers in the descriptor `desc` (`desc_len` bytes), one
/// per granule, in order (none for a segment pool's block): what an exporter sends over a Unix socket (`SCM_RIGHTS`) to an
/// importer that may not fetch them itself. `*out_n` receives the count; `fds == NULL` with
/// `cap == 0` only asks it. The descriptors stay owned by gpupool: do not close them.
///
/// # Safety
/// `desc` must point to `desc_len` readable bytes; `fds` NULL or `cap` writable ints;
/// `out_n` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gpupool_ipc_descriptor_fds(desc: *const c_void, desc_len: usize, fds: *mut c_int, cap: usize, out_n: *mut usize) -> Status {
    call(|| {
        if out_n.is_null() {
            return Err(Error::NullArgument("out_n"));
        }
        let theirs = read_descriptor(desc, desc_len)?.fds();
        *out_n = theirs.len();
        if fds.is_null() && cap == 0 {
            return Ok(());
        }
        if fds.is_null() {
            return Err(Error::NullArgument("fds"));
        }
        if cap < theirs.len() {
            return Err(Error::InvalidArgument(format!("the descriptor has {} file descriptors, the array {cap}", theirs.len())));
        }
        for (i, fd) in theirs.into_iter().enumerate() {
            *fds.add(i) = fd;
        }
        Ok(())
    })
}

/// Map the block another process exported (`desc`, `desc_len` bytes from
/// `gpupool_ipc_export`) on `device`; `*out_ptr` receives its address here. `fds`: this
/// process's copies of the exporter's file descriptors (`n_fds`, in the order
/// `gpupool_ipc_descriptor_fds` lists them, one per granule, or each number of that list
/// once, in the order of its first appearance: the granules of a chunk share one; they
/// stay the caller's), or NULL to fetch them from the exporter with `pidfd_getfd` (Linux
/// 5.6+, same user, a ptrace policy that allows it). Undo with `gpupool_ipc_close`.
///
/// # Safety
/// `desc` must point to `desc_len` readable bytes; `fds` NULL or `n_fds` readable ints;
/// `out_ptr` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gpupool_ipc_open(
    desc: *const c_void,
    desc_len: usize,
    device: c_int,
    fds: *const c_int,
    n_fds: usize,
    out_ptr: *mut *mut c_void,
) -> Status {
    call(|| {
        if out_ptr.is_null() {
            return Err(Error::NullArgument("out_ptr"));
        }
        *out_ptr = std::ptr::null_mut();
        // Decoded and checked here, before the pool's lock and before `fds` is read.
        let d = read_descriptor(desc, desc_len)?;
        // More than one a granule is no list an importer takes: refused before `fds` is read.
        if !fds.is_null() && n_fds > d.fds().len() {
            return Err(Error::InvalidArgument(format!("IPC import: {n_fds} descriptors passed for a block of {} granules", d.fds().len())));
        }
        let given = (!fds.is_null()).then(|| std::slice::from_raw_parts(fds, n_fds));
        *out_ptr = d.open(device, given)? as *mut c_void;
        Ok(())
    })
}

/// Close a block `gpupool_ipc_open` mapped on `device` (the exporter's memory is
/// untouched). `ptr` must be the address it returned, open; any other (a second close
/// included) is `GPUPOOL_STATUS_INVALID_POINTER`. A block opened by fetching the exporter's
/// descriptors (`fds` NULL) stays mapped, kept for the exporter's next message, and its
/// close does not wait for the device: finish this process's work on the block before
/// telling the exporter you are done (as with CUDA's own IPC handles). A block opened with
/// descriptors passed in is unmapped, after the work this process queued on the device is
/// waited for. A device's pool cannot be reconfigured while blocks of other processes are
/// open on it (`GPUPOOL_STATUS_BUSY`).
#[no_mangle]
pub extern "C" fn gpupool_ipc_close(ptr: *mut c_void, device: c_int) -> Status {
    call(|| {
        if ptr.is_null() {
            return Err(Error::NullArgument("ptr"));
        }
        descriptor::close(device, ptr as usize)
    })
}

/// The live block `ptr` as a handle in PyTorch's own format (`shareIpcHandle`), for the
/// allocator class to return: a receiver on PyTorch's allocator opens it, and a gpupool
/// receiver (`gpupool_ipc_open_torch`) opens gpupool's descriptor carried behind it
/// (`src/share/torch_format.rs`). `*out_offset` receives where the block starts in what
/// the handle maps (PyTorch's `ShareableHandle::offset`). Blocks that share granules are
/// exported. Lengths as `gpupool_ipc_export`.
///
/// # Safety
/// As `gpupool_ipc_export`; `out_offset` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gpupool_ipc_export_torch(ptr: *mut c_void, buf: *mut c_void, buf_len: usize, out_len: *mut usize, out_offset: *mut usize) -> Status {
    call(|| {
        if out_len.is_null() {
            return Err(Error::NullArgument("out_len"));
        }
        if out_offset.is_null() {
            return Err(Error::NullArgument("out_offset"));
        }
        if ptr.is_null() {
            return Err(Error::NullArgument("ptr"));
        }
        let h = crate::share::export::export_torch(ptr as usize)?;
        *out_offset = h.offset as usize;
        hand_out(&h.bytes, buf, buf_len, out_len, "the PyTorch handle")
    })
}

/// Open a handle `shareIpcHandle` made (`handle`, `len` bytes) on `device`: gpupool's (as
/// `gpupool_ipc_open` with descriptors fetched from the exporter, or handed by its thread
/// where that is refused), or PyTorch's own from a process on PyTorch's allocator (a
/// `cudaMalloc` segment through CUDA's IPC; an expandable segment by copying the sender's
/// descriptors with `pidfd_getfd`). `*out_base` receives the address PyTorch adds the
/// storage's offset to; `*out_block` what `gpupool_ipc_close` takes to close it.
///
/// # Safety
/// `handle` must point to `len` readable bytes; `out_base`, `out_block` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gpupool_ipc_open_torch(handle: *const c_void, len: usize, device: c_int, out_base: *mut *mut c_void, out_block: *mut *mut c_void) -> Status {
    call(|| {
        if out_base.is_null() || out_block.is_null() {
            return Err(Error::NullArgument(if out_base.is_null() { "out_base" } else { "out_block" }));
        }
        *out_base = std::ptr::null_mut();
        *out_block = std::ptr::null_mut();
        if handle.is_null() {
            return Err(Error::NullArgument("handle"));
        }
        if len > descriptor::MAX_BYTES + 4096 {
            return Err(Error::InvalidArgument(format!("IPC handle: {len} bytes is longer than any handle")));
        }
        let (base, block) = torch_format::open(std::slice::from_raw_parts(handle as *const u8, len), device)?;
        *out_base = base as *mut c_void;
        *out_block = block as *mut c_void;
        Ok(())
    })
}
