//! The close-on-exec window of exported descriptors: the driver's export hands out a
//! descriptor without close-on-exec, and gpupool marks it so right after
//! (`gpupool::share::protocol::new_fd_cloexec`). A `fork()` in another thread in between
//! waits (the fork handlers take the window's lock), so a child never holds such a
//! descriptor unmarked, and a program it execs never inherits it.

use gpupool::share::protocol::new_fd_cloexec;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

#[test]
fn a_fork_during_an_export_waits_until_its_descriptor_is_close_on_exec() {
    // The fork handlers are installed on the first call that reaches a device's pool.
    let st = unsafe { gpupool::ffi::core::gpupool_configure(0, c"split".as_ptr(), c"host".as_ptr()) };
    assert_eq!(st, gpupool::Status::Ok);
    let fd = Arc::new(AtomicI32::new(-1));
    let (inside, window_open) = mpsc::channel();
    let exporter = {
        let fd = fd.clone();
        std::thread::spawn(move || {
            new_fd_cloexec(|| -> Result<i32, ()> {
                // Stands in for the driver's export: a descriptor without close-on-exec,
                // and a while before the flag is set.
                let mut p = [0i32; 2];
                assert_eq!(unsafe { libc::pipe(p.as_mut_ptr()) }, 0);
                unsafe { libc::close(p[1]) };
                fd.store(p[0], Ordering::SeqCst);
                inside.send(()).unwrap();
                std::thread::sleep(Duration::from_millis(300));
                Ok(p[0])
            })
            .unwrap()
        })
    };
    window_open.recv().unwrap();
    let watched = fd.load(Ordering::SeqCst);
    // SAFETY: the child makes async-signal-safe calls only (fcntl, _exit).
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // What an exec now would inherit: the descriptor, open without close-on-exec.
        let flags = unsafe { libc::fcntl(watched, libc::F_GETFD) };
        let inherited = flags >= 0 && flags & libc::FD_CLOEXEC == 0;
        unsafe { libc::_exit(inherited as i32) };
    }
    assert!(pid > 0, "fork failed: {}", std::io::Error::last_os_error());
    let mut status = 0;
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status), "the child did not exit normally ({status:#x})");
    assert_eq!(libc::WEXITSTATUS(status), 0, "a child forked while the export's descriptor lacked close-on-exec holds it unmarked");
    let got = exporter.join().unwrap();
    assert_eq!(got, watched);
    let flags = unsafe { libc::fcntl(got, libc::F_GETFD) };
    assert!(flags >= 0 && flags & libc::FD_CLOEXEC != 0, "the descriptor is close-on-exec once the export returns");
    unsafe { libc::close(got) };
}

/// A fork child while other threads share (holds taken and released in a loop): the
/// sharing calls answer `STOPPED` at once instead of waiting for a lock a parent thread
/// held at the fork.
#[test]
fn a_fork_child_is_refused_by_the_sharing_calls_without_waiting() {
    use gpupool::ffi::share::{gpupool_share_hold, gpupool_share_release};
    let st = unsafe { gpupool::ffi::core::gpupool_configure(1, c"arena".as_ptr(), c"host".as_ptr()) };
    assert_eq!(st, gpupool::Status::Ok);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let busy = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let (mut fd, mut slot) = (0, 0);
                assert_eq!(unsafe { gpupool_share_hold(&mut fd, &mut slot) }, gpupool::Status::Ok);
                assert_eq!(gpupool_share_release(fd, slot), gpupool::Status::Ok);
            }
        })
    };
    for _ in 0..50 {
        // SAFETY: the child calls the library (which allocates; glibc's malloc is fork-safe)
        // and exits; SIGALRM kills it if a call waits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            unsafe { libc::alarm(5) };
            let (mut fd, mut slot) = (0, 0);
            let st = unsafe { gpupool_share_hold(&mut fd, &mut slot) };
            unsafe { libc::_exit(if st == gpupool::Status::Stopped { 0 } else { 1 }) };
        }
        let mut status = 0;
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "child status {status:#x}");
    }
    stop.store(true, Ordering::Relaxed);
    busy.join().unwrap();
}
