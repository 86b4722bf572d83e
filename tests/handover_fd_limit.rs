//! A taker that may not open as many files as a handover carries gets an error that says
//! so (the kernel drops descriptors that do not fit: `MSG_CTRUNC`), none of the ones that
//! did arrive stay open, and its kept connection still serves the next handover. A binary
//! of its own: the open-file limit is the whole process's.

use gpupool::handover::{add, offer, take};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

fn open_count() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

#[test]
fn a_handover_over_the_open_file_limit_fails_clearly_and_leaks_nothing() {
    let files: Vec<OwnedFd> = (0..300)
        .map(|_| {
            let fd = unsafe { libc::memfd_create(c"limit".as_ptr(), libc::MFD_CLOEXEC) };
            assert!(fd >= 0);
            unsafe { OwnedFd::from_raw_fd(fd) }
        })
        .collect();
    let raw: Vec<i32> = files.iter().map(|f| f.as_raw_fd()).collect();
    let ticket = offer().unwrap();
    add(&ticket, &raw, 1).unwrap();
    let small = offer().unwrap();
    add(&small, &raw[..3], 1).unwrap();

    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    let highest = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u64>().ok())
        .max()
        .unwrap();
    // Room for the connection and a few descriptors, not for 300.
    let tight = libc::rlimit { rlim_cur: highest + 40, rlim_max: lim.rlim_max };
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &tight) }, 0);
    let before = open_count();
    let e = take(&ticket).unwrap_err().to_string();
    let after = open_count();
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
    assert!(e.contains("ulimit"), "{e}");
    // Only the kept connection (and the server's side of it) is new.
    assert!(after <= before + 2, "descriptors left open: {before} -> {after}");

    let (got, sends) = take(&small).unwrap();
    assert_eq!((got.len(), sends), (3, 1));
}
