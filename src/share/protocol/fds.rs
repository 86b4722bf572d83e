//! This process's file descriptors for shared memory: the open-file limit raised once, and
//! the close-on-exec window `fork()` waits for.

/// Raise this process's soft limit on open files to its hard limit, once. Why: an exported
/// granule keeps one descriptor open while it is mapped, so a 4 GiB block holds 2,048,
/// past the usual soft limit of 1,024; the hard limit is what the administrator allows
/// (the Go runtime raises it the same way at start). Programs this process starts inherit
/// the raised limit: a library cannot tell a fork child that will exec from one that goes
/// on with the parent's descriptors (a data loader's worker), which a lowered limit would
/// starve of files.
pub fn raise_fd_limit() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let mut l = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: a writable struct, then the same struct back.
        unsafe {
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) == 0 && l.rlim_cur < l.rlim_max {
                l.rlim_cur = l.rlim_max;
                libc::setrlimit(libc::RLIMIT_NOFILE, &l);
            }
        }
    });
}

/// Held from the moment a descriptor exists without close-on-exec until it is marked so.
/// `crate::fork`'s prepare handler takes it too (after the pool locks), so `fork()` waits
/// for the window to close and no child starts with such a descriptor open.
static CLOEXEC_WINDOW: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Run `make`, which creates a descriptor without close-on-exec (the driver's export of a
/// shareable handle cannot ask for the flag), and mark what it returns close-on-exec, with
/// `fork()` held off in between: a thread that forks meanwhile (and then execs) gives its
/// child no copy of it. Spawns that run no fork handlers (`posix_spawn`, `vfork`) are not
/// held off (docs/ipc.md).
pub fn new_fd_cloexec<E>(make: impl FnOnce() -> std::result::Result<i32, E>) -> std::result::Result<i32, E> {
    let _window = hold_cloexec_window();
    let fd = make()?;
    set_cloexec(fd);
    Ok(fd)
}

/// The close-on-exec window's lock (`new_fd_cloexec`), for the fork handlers to hold across
/// a fork. It guards no data, so a poisoned lock is taken as it is.
pub fn hold_cloexec_window() -> std::sync::MutexGuard<'static, ()> {
    CLOEXEC_WINDOW.lock().unwrap_or_else(|e| e.into_inner())
}

/// Mark `fd` close-on-exec, so an exported granule's descriptor does not leak into the
/// programs this process starts (the driver's export does not set it).
pub fn set_cloexec(fd: i32) {
    // SAFETY: flag calls on a descriptor this process owns.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFD);
        if flags >= 0 {
            libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
        }
    }
}
