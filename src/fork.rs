//! `fork()`: a child process gets a clear error from every call instead of a hang or
//! corrupted books.
//!
//! Why: CUDA contexts and device memory do not survive `fork()` (the CUDA documentation
//! says a child must not use CUDA state its parent created), and a pool lock held by another
//! parent thread at the moment of the fork would stay locked forever in the child, which
//! has only the forking thread. So:
//! - before the fork (`pthread_atfork` prepare), the forking thread takes every pool lock,
//!   so no other thread is in the middle of an update when memory is copied, and then the
//!   close-on-exec window's lock (`crate::share::protocol::new_fd_cloexec`), so no child
//!   starts holding an exported descriptor that is not yet close-on-exec; after it (parent
//!   and child handlers) the locks are released again;
//! - in the child every entry point then fails with `Status::Stopped` saying why (those
//!   of sharing too, whose own locks the handlers do not take: the child never waits for
//!   them), and the thread caches' fast path hands nothing out;
//! - the at-exit hooks do not run in the child (`process.rs`): its trace writer thread and
//!   pools are the parent's.
//!
//! Use the `spawn` start method (Python multiprocessing, `torch.multiprocessing`) or
//! `exec` for child processes that need the GPU.

use crate::error::{Error, Result};
use crate::pool::Pool;
use crate::process::in_child;
use crate::share::protocol::hold_cloexec_window;
use std::cell::RefCell;
use std::sync::{MutexGuard, Once, OnceLock};

/// Every pool lock, taken (the registry's, handed over at registration).
pub type LockAll = fn() -> Vec<MutexGuard<'static, Option<Pool>>>;

static REGISTER: Once = Once::new();
static LOCK_ALL: OnceLock<LockAll> = OnceLock::new();

thread_local! {
    /// The pool locks the forking thread holds between prepare and parent/child.
    static HELD: RefCell<Vec<MutexGuard<'static, Option<Pool>>>> = const { RefCell::new(Vec::new()) };
    /// The close-on-exec window's lock, held likewise.
    static WINDOW: RefCell<Option<MutexGuard<'static, ()>>> = const { RefCell::new(None) };
}

extern "C" fn prepare() {
    // Never unwind into libc.
    let _ = std::panic::catch_unwind(|| {
        if let Some(lock_all) = LOCK_ALL.get() {
            let guards = lock_all();
            let _ = HELD.try_with(|h| *h.borrow_mut() = guards);
        }
        // After the pool locks: an export takes the window inside its pool's lock, so this
        // order is the one every thread takes them in.
        let window = hold_cloexec_window();
        let _ = WINDOW.try_with(|w| *w.borrow_mut() = Some(window));
    });
}

extern "C" fn release() {
    let _ = std::panic::catch_unwind(|| {
        let _ = WINDOW.try_with(|w| w.borrow_mut().take());
        let _ = HELD.try_with(|h| h.borrow_mut().clear());
    });
}

extern "C" fn child() {
    crate::process::mark_child();
    release();
}

/// Install the fork handlers (once per process; called on first use of the registry, which
/// hands over how to take every pool lock).
pub fn register(lock_all: LockAll) {
    REGISTER.call_once(|| {
        let _ = LOCK_ALL.set(lock_all);
        // SAFETY: registering plain extern "C" functions that never unwind.
        unsafe { libc::pthread_atfork(Some(prepare), Some(release), Some(child)) };
    });
}

/// `Err(Stopped)` in a fork child; installs the handlers on first call.
pub fn check(lock_all: LockAll) -> Result<()> {
    register(lock_all);
    refuse_in_child()
}

/// `Err(Stopped)` in a fork child: for the entry points that reach no pool (sharing's
/// holds, handovers), whose locks another parent thread may have held at the fork and
/// which the child must not wait for.
pub fn refuse_in_child() -> Result<()> {
    if in_child() {
        return Err(Error::Stopped(
            "this process is a fork() child of the process that created gpupool's pools; CUDA memory and contexts do not \
             survive fork(): start child processes with the 'spawn' method (multiprocessing, torch.multiprocessing) or exec"
                .into(),
        ));
    }
    Ok(())
}
