//! The descriptor thread rests its listener when `accept` fails for want of descriptors
//! (the connection stays queued and the listener readable: without a rest the thread spins
//! a CPU), and serves the queued taker once descriptors are free again. A binary of its own:
//! the open-file limit is the whole process's.

use gpupool::share::handover::{add, offer, take, KEY_BYTES};
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

    // Descriptors free again: the queued taker is accepted and served.
    drop(queued);
    let (got, sends) = take(&ticket).unwrap();
    assert_eq!((got.len(), sends), (1, 1));
}
