//! The C entry points of opening a message's sends ahead while the interpreter unpickles
//! it (`crate::share::ahead` says why and how): they read the caller's arrays and hand the
//! imports out as DLPack tensors.

use super::boundary::call;
use super::share::dlpack;
use crate::error::Error;
use crate::share::ahead::{Batch, Send};
use std::ffi::{c_int, c_void};

/// Start opening `n` sends on a thread of the library. Send `i` is the descriptor of
/// `desc_lens[i]` bytes that follows the previous ones in `descs`, on device `devices[i]`,
/// with hold `slots[i]`; its `n_fds[i]` entries of `fds` (following the previous sends')
/// are the holds file's descriptor (-1: no hold) and then the block's descriptors, as
/// `gpupool_ipc_open_dlpack` takes them (one per granule, or each exporter number once in
/// the order of its first appearance). Every descriptor is copied before this returns:
/// the caller's stay the caller's. `*out_batch` receives the batch: take each send's
/// import with `gpupool_share_take_ahead`, and end it with `gpupool_share_end_ahead`
/// (exactly once).
///
/// # Safety
/// `desc_lens`, `devices`, `slots` and `n_fds` hold `n` readable entries, `descs` their
/// sum of `desc_lens` bytes and `fds` that of `n_fds` ints; `out_batch` writable.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn gpupool_share_open_ahead(
    n: usize,
    descs: *const c_void,
    desc_lens: *const usize,
    devices: *const c_int,
    slots: *const u32,
    fds: *const c_int,
    n_fds: *const usize,
    out_batch: *mut *mut c_void,
) -> crate::error::Status {
    call(|| {
        crate::fork::refuse_in_child()?;
        if out_batch.is_null() {
            return Err(Error::NullArgument("out_batch"));
        }
        *out_batch = std::ptr::null_mut();
        if n > 0 && [desc_lens.is_null(), devices.is_null(), slots.is_null(), n_fds.is_null()].contains(&true) {
            return Err(Error::NullArgument("desc_lens, devices, slots or n_fds"));
        }
        let (lens, counts) = if n == 0 { (&[][..], &[][..]) } else { (std::slice::from_raw_parts(desc_lens, n), std::slice::from_raw_parts(n_fds, n)) };
        let mut total_bytes = 0usize;
        for &l in lens {
            if l > crate::share::descriptor::MAX_BYTES {
                return Err(Error::InvalidArgument(format!("IPC descriptor: {l} bytes is longer than any descriptor")));
            }
            // Each at most descriptor::MAX_BYTES; a count that still overflows is refused.
            total_bytes = total_bytes.checked_add(l).ok_or_else(|| Error::InvalidArgument("opening sends ahead: descriptor lengths out of range".into()))?;
        }
        let total_fds = counts.iter().try_fold(0usize, |a, &c| a.checked_add(c)).ok_or_else(|| Error::InvalidArgument("opening sends ahead: descriptor counts out of range".into()))?;
        if counts.contains(&0) {
            return Err(Error::InvalidArgument("opening sends ahead: each send needs at least its holds file's entry".into()));
        }
        if total_bytes > 0 && descs.is_null() {
            return Err(Error::NullArgument("descs"));
        }
        if total_fds > 0 && fds.is_null() {
            return Err(Error::NullArgument("fds"));
        }
        let bytes = if total_bytes == 0 { &[][..] } else { std::slice::from_raw_parts(descs.cast::<u8>(), total_bytes) };
        let all_fds = if total_fds == 0 { &[][..] } else { std::slice::from_raw_parts(fds, total_fds) };
        let (mut at_byte, mut at_fd) = (0, 0);
        let mut sends = Vec::with_capacity(n);
        for i in 0..n {
            let mine = &all_fds[at_fd..at_fd + counts[i]];
            sends.push(Send {
                desc: bytes[at_byte..at_byte + lens[i]].to_vec(),
                device: *devices.add(i),
                holds_fd: mine[0],
                slot: *slots.add(i),
                fds: mine[1..].to_vec(),
            });
            at_byte += lens[i];
            at_fd += counts[i];
        }
        *out_batch = Box::into_raw(Box::new(Batch::start(sends)?)).cast();
        Ok(())
    })
}

/// Send `i`'s import from `batch` (waiting for it if the thread has not reached it):
/// `*out_tensor` receives the `DLManagedTensor*` `gpupool_ipc_open_dlpack` would have made
/// (now the caller's), or NULL where the send was not opened ahead (the batch ended before
/// it, or it was taken already): open it as usual then. An import that failed returns its
/// error, as `gpupool_ipc_open_dlpack` would have.
///
/// # Safety
/// `batch` from `gpupool_share_open_ahead`, not yet ended; `out_tensor` writable.
#[no_mangle]
pub unsafe extern "C" fn gpupool_share_take_ahead(batch: *mut c_void, i: usize, out_tensor: *mut *mut c_void) -> crate::error::Status {
    call(|| {
        crate::fork::refuse_in_child()?;
        if batch.is_null() || out_tensor.is_null() {
            return Err(Error::NullArgument(if batch.is_null() { "batch" } else { "out_tensor" }));
        }
        *out_tensor = std::ptr::null_mut();
        if let Some(r) = (*batch.cast::<Batch>()).take(i)? {
            *out_tensor = dlpack(r).cast();
        }
        Ok(())
    })
}

/// End `batch`: the thread opens nothing more and is waited for, what no rebuild took is
/// closed, and the batch is freed. `failed` 0: the message unpickled, and a send no
/// rebuild took keeps its hold (whoever kept it may still open it). Otherwise the message
/// failed and nobody will open its sends: every send not taken is let go (its hold
/// released), whether or not the thread had opened it.
///
/// # Safety
/// `batch` from `gpupool_share_open_ahead`, not ended before (NULL: nothing happens).
#[no_mangle]
pub unsafe extern "C" fn gpupool_share_end_ahead(batch: *mut c_void, failed: c_int) -> crate::error::Status {
    call(|| {
        crate::fork::refuse_in_child()?;
        if batch.is_null() {
            return Ok(());
        }
        Box::from_raw(batch.cast::<Batch>()).end(failed != 0);
        Ok(())
    })
}

/// What opening sends ahead has cost this process so far, as JSON (same buffer convention
/// as `gpupool_memory_status`): `batches` started; seconds from a batch's start to its
/// thread's first line (`thread_start_s`), spent by the threads opening sends
/// (`opening_s`) and by rebuilds waiting for them (`take_wait_s`); and `imports`: how many
/// arena imports this process made or tried on a GPU, ahead or not (`count`), with the
/// seconds spent in each kind of driver call they make (`reserve_s`, `import_s` with the
/// descriptor's checks, `map_s`, `release_s`, `grant_s`).
///
/// # Safety
/// `buf` must be NULL or point to `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn gpupool_share_ahead_json(buf: *mut std::ffi::c_char, len: usize) -> usize {
    super::boundary::call_value(0, || super::boundary::write_str(&crate::share::ahead::report_json(), buf, len))
}
