//! The handover within one process (its own server answers its own takes): what arrives,
//! in which order, once; withdrawal; bad tickets. Across processes: `tests/python/test_share.py`
//! and the fd-limit test in `tests/handover_fd_limit.rs`.

use super::wire::PER_MESSAGE;
use super::*;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::time::Duration;

/// A file whose identity (device, inode) tells copies of its descriptor apart from others.
fn memfd(tag: &str) -> OwnedFd {
    let name = std::ffi::CString::new(tag).unwrap();
    // SAFETY: a new descriptor this function owns.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    unsafe { OwnedFd::from_raw_fd(fd) }
}

fn identity(fd: RawFd) -> crate::share::protocol::FileId {
    crate::share::protocol::FileId::of(fd).unwrap()
}

#[test]
fn a_handover_arrives_whole_in_order_once() {
    // More than one message's worth, so the taker reads several SCM_RIGHTS messages.
    let files: Vec<OwnedFd> = (0..PER_MESSAGE * 2 + 7).map(|i| memfd(&format!("h{i}"))).collect();
    let raw: Vec<RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
    let ticket = offer().unwrap();
    add(&ticket, &raw[..100], 2).unwrap();
    add(&ticket, &raw[100..], 3).unwrap();
    let (got, sends) = take(&ticket).unwrap();
    assert_eq!(sends, 5);
    assert_eq!(got.len(), files.len());
    for (mine, theirs) in got.iter().zip(&files) {
        assert_ne!(mine.as_raw_fd(), theirs.as_raw_fd(), "a new descriptor, not the sender's number");
        assert_eq!(identity(mine.as_raw_fd()), identity(theirs.as_raw_fd()));
    }
    // Taken once: the same ticket again is refused, and the kept connection still serves
    // the next handover.
    let again = take(&ticket).unwrap_err().to_string();
    assert!(again.contains("taken once"), "{again}");
    let next = offer().unwrap();
    add(&next, &raw[..1], 1).unwrap();
    let (one, sends) = take(&next).unwrap();
    assert_eq!((one.len(), sends), (1, 1));
    assert_eq!(identity(one[0].as_raw_fd()), identity(raw[0]));
}

#[test]
fn the_sender_keeps_its_own_descriptors() {
    let f = memfd("kept");
    let ticket = offer().unwrap();
    add(&ticket, &[f.as_raw_fd()], 1).unwrap();
    let (got, _) = take(&ticket).unwrap();
    drop(got);
    // The caller's descriptor is still open (the handover held copies).
    assert!(unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GETFD) } >= 0);
}

#[test]
fn a_withdrawn_handover_cannot_be_taken() {
    let f = memfd("w");
    let ticket = offer().unwrap();
    add(&ticket, &[f.as_raw_fd()], 1).unwrap();
    assert!(withdraw(&ticket).unwrap());
    assert!(!withdraw(&ticket).unwrap(), "twice is not an error, and says it was gone");
    let e = take(&ticket).unwrap_err().to_string();
    assert!(e.contains("no such handover"), "{e}");
    // Adding to it now is refused too.
    assert!(add(&ticket, &[f.as_raw_fd()], 1).is_err());
}

#[test]
fn an_empty_handover_arrives_empty() {
    let ticket = offer().unwrap();
    let (got, sends) = take(&ticket).unwrap();
    assert!(got.is_empty());
    assert_eq!(sends, 0);
}

#[test]
fn bad_tickets_and_descriptors_are_refused() {
    assert!(matches!(take(&[1, 2, 3]), Err(Error::InvalidArgument(_))));
    // A well-formed ticket naming a socket nobody listens on.
    let mut t = vec![0u8; KEY_BYTES];
    t.extend_from_slice(b"gpupool-handover-nobody-listens-here");
    let e = take(&t).unwrap_err().to_string();
    assert!(e.contains("is gone"), "{e}");
    // A descriptor that is not open: refused, and the handover is unchanged.
    let ticket = offer().unwrap();
    let e = add(&ticket, &[-1], 1).unwrap_err().to_string();
    assert!(e.contains("cannot be copied"), "{e}");
    let (got, sends) = take(&ticket).unwrap();
    assert_eq!((got.len(), sends), (0, 0));
}

#[test]
fn concurrent_takers_each_get_their_own() {
    let files: Vec<OwnedFd> = (0..8).map(|i| memfd(&format!("c{i}"))).collect();
    let tickets: Vec<(Vec<u8>, crate::share::protocol::FileId)> = files
        .iter()
        .map(|f| {
            let t = offer().unwrap();
            add(&t, &[f.as_raw_fd()], 1).unwrap();
            (t, identity(f.as_raw_fd()))
        })
        .collect();
    std::thread::scope(|s| {
        for (t, want) in &tickets {
            s.spawn(move || {
                let (got, _) = take(t).unwrap();
                assert_eq!(identity(got[0].as_raw_fd()), *want);
            });
        }
    });
}

#[test]
fn a_taker_that_stalls_midway_does_not_stop_the_others() {
    let f = memfd("stall");
    let ticket = offer().unwrap();
    add(&ticket, &[f.as_raw_fd()], 1).unwrap();
    // Half a key, then nothing: the server gives up on this one after its timeout.
    let addr = SocketAddr::from_abstract_name(&ticket[KEY_BYTES..]).unwrap();
    let mut stalled = UnixStream::connect_addr(&addr).unwrap();
    stalled.write_all(&ticket[..3]).unwrap();
    let silent = UnixStream::connect_addr(&addr).unwrap(); // connected, never writes
    std::thread::sleep(Duration::from_millis(50));
    let (got, _) = take(&ticket).unwrap();
    assert_eq!(identity(got[0].as_raw_fd()), identity(f.as_raw_fd()));
    // Requests are read as they arrive: the half key kept nobody waiting for its deadline,
    // after which the server would have closed the stalled connection (read: end of file).
    stalled.set_nonblocking(true).unwrap();
    let mut b = [0u8; 1];
    let e = std::io::Read::read(&mut stalled, &mut b).expect_err("the server answered or closed the stalled taker");
    assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock, "the stalled taker's connection: {e}");
    drop((stalled, silent));
}

fn fd_table_size() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("FDSize:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn prepare_grows_the_file_table_once_up_front() {
    prepare(false).unwrap();
    let mut l = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) }, 0);
    assert_eq!(l.rlim_cur, l.rlim_max, "the soft limit raised to the hard one");
    let want = l.rlim_cur.min(FD_TABLE);
    assert!(fd_table_size() >= want, "FDSize {} < {want}", fd_table_size());
}

extern "C" fn ignore_signal(_: libc::c_int) {}

#[test]
fn takes_interrupted_by_signals_complete_and_do_not_cross() {
    // A handler without SA_RESTART, as CPython installs its own: every blocking call of a
    // signalled thread returns EINTR.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = ignore_signal as *const () as usize;
        libc::sigaction(libc::SIGUSR2, &sa, std::ptr::null_mut());
    }
    let files: Vec<OwnedFd> = (0..1000).map(|i| memfd(&format!("i{i}"))).collect();
    let raw: Vec<RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
    for _ in 0..30 {
        let big = offer().unwrap();
        add(&big, &raw, 1).unwrap();
        let small = offer().unwrap();
        add(&small, &raw[999..], 1).unwrap();
        let target = std::sync::atomic::AtomicUsize::new(0);
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            let a = s.spawn(|| {
                target.store(unsafe { libc::pthread_self() } as usize, std::sync::atomic::Ordering::SeqCst);
                take(&big)
            });
            while target.load(std::sync::atomic::Ordering::SeqCst) == 0 {}
            let b = s.spawn(|| take(&small));
            let k = s.spawn(|| {
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    unsafe { libc::pthread_kill(target.load(std::sync::atomic::Ordering::SeqCst) as libc::pthread_t, libc::SIGUSR2) };
                    std::thread::sleep(Duration::from_micros(20));
                }
            });
            let got_a = a.join();
            stop.store(true, std::sync::atomic::Ordering::SeqCst);
            k.join().unwrap();
            let (got_a, _) = got_a.unwrap().unwrap();
            let (got_b, _) = b.join().unwrap().unwrap();
            assert_eq!(got_a.len(), 1000);
            assert_eq!(identity(got_a[999].as_raw_fd()), identity(raw[999]));
            assert_eq!(got_b.len(), 1);
            assert_eq!(identity(got_b[0].as_raw_fd()), identity(raw[999]));
        });
    }
}

#[test]
fn a_taker_that_trickles_its_request_is_cut_off_by_the_deadline() {
    let f = memfd("trickle");
    let ticket = offer().unwrap();
    add(&ticket, &[f.as_raw_fd()], 1).unwrap();
    let addr = SocketAddr::from_abstract_name(&ticket[KEY_BYTES..]).unwrap();
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            // One byte of a key every 300 ms: each read returns in time, the request never does.
            let mut slow = UnixStream::connect_addr(&addr).unwrap();
            for b in 0..KEY_BYTES as u8 {
                if done.load(std::sync::atomic::Ordering::SeqCst) || slow.write_all(&[b]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(300));
            }
        });
        std::thread::sleep(Duration::from_millis(100));
        let t = std::time::Instant::now();
        let (got, _) = take(&ticket).unwrap();
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(identity(got[0].as_raw_fd()), identity(f.as_raw_fd()));
        assert!(t.elapsed() < Duration::from_secs(3), "waited {:?} behind a trickling taker", t.elapsed());
    });
}

#[test]
fn a_fork_child_closes_the_servers_files_and_no_number_reused_since() {
    let _ = offer().unwrap(); // the server runs and the fork handlers are in
    let t0 = std::time::Instant::now();
    while server::SERVER_FDS.lock().unwrap().is_empty() {
        assert!(t0.elapsed() < Duration::from_secs(5), "the server thread never listed its listener");
        std::thread::sleep(Duration::from_millis(1));
    }
    let listener = server::SERVER_FDS.lock().unwrap()[0].0;
    // A number the list still names though its file changed (a taker closed, the number
    // handed out again): the list says one file, the number holds another.
    let reused = memfd("reused");
    let other = memfd("other");
    server::SERVER_FDS.lock().unwrap().push((reused.as_raw_fd(), crate::share::protocol::FileId::of(other.as_raw_fd()).unwrap()));
    // SAFETY: the child only asks two descriptors' flags and exits.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let open = |fd: RawFd| unsafe { libc::fcntl(fd, libc::F_GETFD) } >= 0;
        let code = if !open(reused.as_raw_fd()) { 1 } else if open(listener) { 2 } else { 0 };
        unsafe { libc::_exit(code) };
    }
    server::SERVER_FDS.lock().unwrap().retain(|(fd, _)| *fd != reused.as_raw_fd());
    let mut status = 0;
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status));
    match libc::WEXITSTATUS(status) {
        0 => {}
        1 => panic!("the child closed a number the server no longer held"),
        2 => panic!("the child kept the server's listener open"),
        c => panic!("child exit {c}"),
    }
    // The parent's listener is untouched: a take still works.
    let f = memfd("after");
    let t = offer().unwrap();
    add(&t, &[f.as_raw_fd()], 1).unwrap();
    assert_eq!(take(&t).unwrap().0.len(), 1);
}
