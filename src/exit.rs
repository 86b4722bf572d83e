//! At-exit work, registered once with `atexit`: flush the trace file and, with
//! `GPUPOOL_DEBUG=1` or more, print the leak summary.

use std::sync::Once;

static REGISTER: Once = Once::new();

extern "C" fn at_exit() {
    // Never unwind into libc.
    let _ = std::panic::catch_unwind(|| {
        if crate::fork::in_child() {
            return; // the trace writer thread and the pools belong to the parent
        }
        crate::trace::finish_global();
        if crate::registry::config().map(|c| c.debug).unwrap_or(0) >= 1 {
            let report = crate::registry::leak_report();
            if !report.starts_with("gpupool: 0 live") {
                crate::error::warn(&report);
            }
        }
    });
}

pub fn register() {
    REGISTER.call_once(|| {
        // SAFETY: registering a plain extern "C" function.
        unsafe { libc::atexit(at_exit) };
    });
}
