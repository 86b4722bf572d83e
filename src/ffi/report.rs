//! Errors inside `void` entry points (framework frees and hooks) have no status to return:
//! they are counted by the pool and written to stderr — an invalid free only once per
//! process, so a buggy caller cannot flood the log.

use std::sync::atomic::{AtomicBool, Ordering};

static INVALID_FREE_REPORTED: AtomicBool = AtomicBool::new(false);

/// Report an error from a `void` entry point.
pub fn void_error(origin: &str, e: &crate::error::Error) {
    super::boundary::record(e);
    if e.status() == crate::error::Status::InvalidPointer || e.status() == crate::error::Status::InvalidArgument {
        if INVALID_FREE_REPORTED.swap(true, Ordering::Relaxed) {
            return;
        }
        eprintln!("{e} (from {origin}; further invalid frees are counted in the stats, not printed)");
    } else {
        eprintln!("{e} (from {origin})");
    }
}
