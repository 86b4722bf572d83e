//! Errors inside `void` entry points (framework frees and hooks) have no status to return:
//! they are counted by the pool and written to stderr — an invalid free only once per
//! process, so a buggy caller cannot flood the log.

use super::boundary::call;
use crate::error::Result;
use std::sync::atomic::{AtomicBool, Ordering};

static INVALID_FREE_REPORTED: AtomicBool = AtomicBool::new(false);

/// Report an error from a `void` entry point.
pub fn void_error(origin: &str, e: &crate::error::Error) {
    super::boundary::record(e);
    if e.status() == crate::error::Status::InvalidPointer || e.status() == crate::error::Status::InvalidArgument {
        if INVALID_FREE_REPORTED.swap(true, Ordering::Relaxed) {
            return;
        }
        crate::error::warn(&format!("{e} (from {origin}; further invalid frees are counted in the stats, not printed)"));
    } else {
        crate::error::warn(&format!("{e} (from {origin})"));
    }
}

/// Run `f` at the boundary for a `void` entry point named `origin`: a failure (or a caught
/// panic) is recorded for `gpupool_last_error` and reported by `void_error`.
pub fn call_void(origin: &str, f: impl FnOnce() -> Result<()>) {
    let mut err = None;
    let status = call(|| f().inspect_err(|e| err = Some(e.clone())));
    match err {
        Some(e) => void_error(origin, &e),
        None if status != crate::error::Status::Ok => {
            void_error(origin, &crate::error::Error::Internal(super::boundary::last_error()))
        }
        None => {}
    }
}
