//! The C boundary: panic catching, status codes, the thread-local last-error message, and
//! safe copies of strings/structs into caller buffers.

use crate::error::{Error, Result, Status};
use std::cell::RefCell;
use std::ffi::{c_char, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

/// Remember `e` as this thread's last error.
pub fn record(e: &Error) {
    let msg = e.to_string();
    let _ = LAST_ERROR.try_with(|l| *l.borrow_mut() = msg);
}

pub fn last_error() -> String {
    LAST_ERROR.try_with(|l| l.borrow().clone()).unwrap_or_default()
}

use crate::error::panic_message;

/// Run `f` at the boundary: map its result (or a panic) to a status.
#[inline]
pub fn call(f: impl FnOnce() -> Result<()>) -> Status {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => Status::Ok,
        Ok(Err(e)) => {
            record(&e);
            e.status()
        }
        Err(p) => {
            let msg = panic_message(p);
            crate::error::set_last_panic(&msg);
            record(&Error::Internal(msg));
            Status::Internal
        }
    }
}

/// Run `f`, which produces a value; a panic gives `fallback` and records an internal error.
pub fn call_value<T>(fallback: T, f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(p) => {
            let msg = panic_message(p);
            crate::error::set_last_panic(&msg);
            record(&Error::Internal(msg));
            fallback
        }
    }
}

/// snprintf-style copy: writes at most `len - 1` bytes of `s` plus a NUL into `buf` (when
/// `buf` is non-null and `len > 0`) and returns `strlen(s)`: the buffer needs one more byte.
///
/// # Safety
/// `buf` must be null or point to `len` writable bytes.
pub unsafe fn write_str(s: &str, buf: *mut c_char, len: usize) -> usize {
    if !buf.is_null() && len > 0 {
        let n = s.len().min(len - 1);
        std::ptr::copy_nonoverlapping(s.as_ptr(), buf as *mut u8, n);
        *buf.add(n) = 0;
    }
    s.len()
}

/// Read an optional C string argument (NULL = not given).
///
/// # Safety
/// `p` must be null or a NUL-terminated string.
pub unsafe fn opt_str<'a>(p: *const c_char, what: &'static str) -> Result<Option<&'a str>> {
    if p.is_null() {
        return Ok(None);
    }
    CStr::from_ptr(p)
        .to_str()
        .map(Some)
        .map_err(|_| Error::InvalidArgument(format!("{what} is not valid UTF-8")))
}
