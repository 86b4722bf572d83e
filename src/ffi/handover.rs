//! Handing file descriptors to the process that unpickles a message (`crate::share::handover`):
//! the transport of `python/gpupool/share.py`, callable from any language.

use super::boundary::call;
use crate::error::{Error, Status};
use crate::share::handover;
use std::ffi::{c_int, c_void};
use std::os::fd::IntoRawFd;

/// # Safety
/// `ticket` must point to `len` readable bytes (or be NULL).
unsafe fn ticket_arg<'a>(ticket: *const c_void, len: usize) -> Result<&'a [u8], Error> {
    if ticket.is_null() {
        return Err(Error::NullArgument("ticket"));
    }
    Ok(std::slice::from_raw_parts(ticket as *const u8, len))
}

/// Ready this process for handovers; call it early (at start-up), so that none of the
/// following lands in a handover's time: the open-file limit raised to its hard limit, the
/// kernel's table of open files grown once (in a process of several threads each growth
/// waits milliseconds), and, with `serve` nonzero, the descriptor thread started (a process
/// that sends). The handover calls do it themselves otherwise.
#[no_mangle]
pub extern "C" fn gpupool_handover_prepare(serve: c_int) -> Status {
    call(|| {
        crate::fork::refuse_in_child()?;
        handover::prepare(serve != 0)
    })
}

/// Start a handover of this process for one taker: its ticket (opaque bytes to send inside
/// the message) into `ticket` (`cap` bytes), its length into `*out_len`; `ticket == NULL`
/// with `cap == 0` only asks the length (no handover is made). The first call of either
/// kind starts the library's descriptor thread (an abstract Unix socket that answers only
/// this user); where it cannot run, this fails and the caller sends descriptors its own way.
///
/// # Safety
/// `ticket` NULL or `cap` writable bytes; `out_len` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gpupool_handover_new(ticket: *mut c_void, cap: usize, out_len: *mut usize) -> Status {
    call(|| {
        crate::fork::refuse_in_child()?;
        if out_len.is_null() {
            return Err(Error::NullArgument("out_len"));
        }
        if ticket.is_null() && cap == 0 {
            *out_len = handover::ticket_len()?;
            return Ok(());
        }
        if ticket.is_null() {
            return Err(Error::NullArgument("ticket"));
        }
        let need = handover::ticket_len()?;
        if cap < need {
            *out_len = need;
            return Err(Error::InvalidArgument(format!("a ticket is {need} bytes, the buffer {cap}")));
        }
        let t = handover::offer()?;
        std::ptr::copy_nonoverlapping(t.as_ptr(), ticket as *mut u8, t.len());
        *out_len = t.len();
        Ok(())
    })
}

/// Add copies of `fds` (`n`; they stay the caller's) to this process's handover `ticket`
/// and `sends` to the number of sends that name it.
///
/// # Safety
/// `ticket` must point to `len` readable bytes; `fds` NULL (with `n == 0`) or `n` readable ints.
#[no_mangle]
pub unsafe extern "C" fn gpupool_handover_add(ticket: *const c_void, len: usize, fds: *const c_int, n: usize, sends: u32) -> Status {
    call(|| {
        crate::fork::refuse_in_child()?;
        let t = ticket_arg(ticket, len)?;
        if fds.is_null() && n > 0 {
            return Err(Error::NullArgument("fds"));
        }
        let given = if n == 0 { &[][..] } else { std::slice::from_raw_parts(fds, n) };
        handover::add(t, given, sends)
    })
}

/// Withdraw this process's handover `ticket` (its message was never sent): its copies of
/// the descriptors close. Not an error if it was taken or withdrawn already.
///
/// # Safety
/// `ticket` must point to `len` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn gpupool_handover_withdraw(ticket: *const c_void, len: usize) -> Status {
    call(|| {
        crate::fork::refuse_in_child()?;
        handover::withdraw(ticket_arg(ticket, len)?).map(drop)
    })
}

/// Take handover `ticket` from the process that offered it: `*out_fds` receives an array
/// of `*out_n` descriptors, now this process's (close them; free the array with
/// `gpupool_handover_free_fds`), in the order they were added; `*out_sends` how many sends
/// name them. A handover is taken once.
///
/// # Safety
/// `ticket` must point to `len` readable bytes; the outputs NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gpupool_handover_take(
    ticket: *const c_void,
    len: usize,
    out_fds: *mut *mut c_int,
    out_n: *mut usize,
    out_sends: *mut u32,
) -> Status {
    call(|| {
        crate::fork::refuse_in_child()?;
        if out_fds.is_null() || out_n.is_null() || out_sends.is_null() {
            return Err(Error::NullArgument(if out_fds.is_null() {
                "out_fds"
            } else if out_n.is_null() {
                "out_n"
            } else {
                "out_sends"
            }));
        }
        *out_fds = std::ptr::null_mut();
        *out_n = 0;
        *out_sends = 0;
        let (fds, sends) = handover::take(ticket_arg(ticket, len)?)?;
        // malloc'd, so the caller frees it with no Rust allocator involved (any size, 0 too).
        let array = libc::malloc(fds.len().max(1) * std::mem::size_of::<c_int>()) as *mut c_int;
        if array.is_null() {
            return Err(Error::Internal("handover: cannot allocate the descriptor array".into()));
        }
        let n = fds.len();
        for (i, fd) in fds.into_iter().enumerate() {
            *array.add(i) = fd.into_raw_fd();
        }
        *out_fds = array;
        *out_n = n;
        *out_sends = sends;
        Ok(())
    })
}

/// Free an array `gpupool_handover_take` returned (not the descriptors in it). NULL is a no-op.
///
/// # Safety
/// `fds` NULL or an array from `gpupool_handover_take`, freed once.
#[no_mangle]
pub unsafe extern "C" fn gpupool_handover_free_fds(fds: *mut c_int) {
    libc::free(fds as *mut c_void);
}

/// The former name of `gpupool_handover_free_fds`, kept so programs built against it link.
///
/// # Safety
/// As `gpupool_handover_free_fds`.
#[deprecated(note = "renamed gpupool_handover_free_fds: it frees the descriptor array, not the handover")]
#[no_mangle]
pub unsafe extern "C" fn gpupool_handover_free(fds: *mut c_int) {
    gpupool_handover_free_fds(fds)
}
