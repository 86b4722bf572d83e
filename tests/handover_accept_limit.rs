//! The descriptor thread rests its listener when `accept` fails for want of descriptors
//! (the connection stays queued and the listener readable: without a rest the thread spins
//! a CPU), and serves the queued taker once descriptors are free again. A binary of its own:
//! the open-file limit is the whole process's.

use gpupool::share::handover::{add, offer, take, KEY_BYTES};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::time::Duration;

fn cpu_seconds() -> f64 {
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) }, 0);
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

#[test]
fn a_failing_accept_rests_the_listener_and_the_taker_is_served_after() {
    let f = unsafe { OwnedFd::from_raw_fd(libc::memfd_create(c"accept".as_ptr(), libc::MFD_CLOEXEC)) };
    let ticket = offer().unwrap();
    add(&ticket, &[f.as_raw_fd()], 1).unwrap();
    let addr = SocketAddr::from_abstract_name(&ticket[KEY_BYTES..]).unwrap();

    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    let tight = libc::rlimit { rlim_cur: 256, rlim_max: lim.rlim_max };
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &tight) }, 0);
    // Every number under the limit taken but one, which the connection takes.
    let mut fill = Vec::new();
    while let Ok(n) = std::fs::File::open("/dev/null") {
        fill.push(n);
    }
    fill.pop();
    let queued = UnixStream::connect_addr(&addr).expect("the last free descriptor");
    let before = cpu_seconds();
    std::thread::sleep(Duration::from_secs(1));
    let spent = cpu_seconds() - before;
    drop(fill);
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
    assert!(spent < 0.5, "{spent:.2} s of CPU in an idle second while accept failed");

    // Descriptors free again: the queued taker is accepted and served, on the connection
    // that waited (the request as a taker writes it: the key).
    let mut queued = queued;
    queued.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    queued.write_all(&ticket[..KEY_BYTES]).unwrap();
    let mut header = [0u8; 12];
    queued.read_exact(&mut header).expect("the queued taker got no answer");
    let word = |i: usize| u32::from_le_bytes(header[i..i + 4].try_into().unwrap());
    assert_eq!((word(0), word(4), word(8)), (0, 1, 1), "status (found), descriptors, sends");
    let got = receive_one_fd(&queued);
    let ino = |fd: i32| {
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        assert_eq!(unsafe { libc::fstat(fd, &mut st) }, 0);
        (st.st_dev, st.st_ino)
    };
    assert_eq!(ino(got.as_raw_fd()), ino(f.as_raw_fd()), "the taker got another file than the one offered");
    // Taken once: the handover is gone.
    assert!(take(&ticket).is_err(), "a handover was served twice");
}

/// One descriptor from an `SCM_RIGHTS` message on `conn`.
fn receive_one_fd(conn: &UnixStream) -> OwnedFd {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec { iov_base: byte.as_mut_ptr().cast(), iov_len: 1 };
    let mut space = [0u64; 8];
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = space.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&space);
    let n = unsafe { libc::recvmsg(conn.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    assert!(n > 0, "recvmsg: {}", std::io::Error::last_os_error());
    let cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    assert!(!cmsg.is_null(), "a message without descriptors");
    unsafe {
        assert_eq!(((*cmsg).cmsg_level, (*cmsg).cmsg_type), (libc::SOL_SOCKET, libc::SCM_RIGHTS));
        let fd = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>());
        OwnedFd::from_raw_fd(fd)
    }
}
