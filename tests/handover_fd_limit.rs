//! A taker that may not open as many files as a handover carries gets an error that says
//! so (the kernel drops descriptors that do not fit: `MSG_CTRUNC`), none of the ones that
//! did arrive stay open, and its kept connection still serves the next handover. A binary
//! of its own: the open-file limit is the whole process's.

use gpupool::share::handover::{add, offer, take};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

fn open_below(limit: u64) -> Vec<u64> {
    let mut v: Vec<u64> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u64>().ok())
        .filter(|&fd| fd < limit)
        .collect();
    v.sort();
    v
}

#[test]
fn a_handover_over_the_open_file_limit_fails_clearly_and_leaks_nothing() {
    // The sender is this process too: its copies (made by `add`) sit above the numbers the
    // taker may use once the limit drops below them, so their closing frees no room.
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
    drop(files);

    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    let tight_at = 100;
    assert!(raw.iter().all(|&f| (f as u64) < 400), "the originals took the low numbers");
    let tight = libc::rlimit { rlim_cur: tight_at, rlim_max: lim.rlim_max };
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &tight) }, 0);
    let before = open_below(tight_at);
    let e = take(&ticket).map(|(f, _)| f.len());
    let after = open_below(tight_at);
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
    let e = e.unwrap_err().to_string();
    assert!(e.contains("ulimit"), "{e}");
    // Only the kept connection (both its ends live here) is new.
    let new: Vec<_> = after.iter().filter(|f| !before.contains(f)).collect();
    assert!(new.len() <= 2, "descriptors left open: {new:?}");

    let (got, sends) = take(&small).unwrap();
    assert_eq!((got.len(), sends), (3, 1));
}
