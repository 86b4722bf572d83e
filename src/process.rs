//! Process-wide state below every layer: whether this process is a `fork()` child of the
//! one that set up the pools (`fork.rs` marks it), and the work to run at exit (the trace
//! file's flush, the leak summary), registered by the modules that own it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, Once};

static CHILD: AtomicBool = AtomicBool::new(false);
static AT_EXIT: Once = Once::new();
static HOOKS: Mutex<Vec<fn()>> = Mutex::new(Vec::new());

/// Whether this process is a `fork()` child of one that used gpupool (one relaxed load:
/// the thread caches' fast path asks).
#[inline]
pub fn in_child() -> bool {
    CHILD.load(Ordering::Relaxed)
}

/// Called by the fork handler in the child.
pub fn mark_child() {
    CHILD.store(true, Ordering::SeqCst);
}

extern "C" fn run_hooks() {
    // Never unwind into libc; a fork child leaves the parent's work (its trace writer
    // thread, its pools) alone.
    let _ = std::panic::catch_unwind(|| {
        if in_child() {
            return;
        }
        let hooks = HOOKS.lock().map(|h| h.clone()).unwrap_or_default();
        for h in hooks {
            let _ = std::panic::catch_unwind(h);
        }
    });
}

/// Run `hook` at process exit (once, however often it is registered).
pub fn on_exit(hook: fn()) {
    AT_EXIT.call_once(|| {
        // SAFETY: registering a plain extern "C" function that never unwinds.
        unsafe { libc::atexit(run_hooks) };
    });
    if let Ok(mut h) = HOOKS.lock() {
        if !h.iter().any(|&f| f as usize == hook as usize) {
            h.push(hook);
        }
    }
}
