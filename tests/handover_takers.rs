//! The descriptor thread keeps at most 1,024 takers' connections: a new taker beyond them
//! closes the one idle longest instead of being turned away, and a taker whose request the
//! sender closed unread sends it again on a new connection. A binary of its own: it opens
//! over two thousand descriptors.

use gpupool::share::handover::{add, offer, take, KEY_BYTES};
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::time::Duration;

fn raise_fd_limit() {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    assert!(lim.rlim_max >= 4096, "this test needs 4096 open files (hard limit {})", lim.rlim_max);
    lim.rlim_cur = lim.rlim_max;
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
}

fn hung_up(s: &UnixStream) -> bool {
    let mut fds = [rustix::event::PollFd::new(s, rustix::event::PollFlags::IN)];
    rustix::event::poll(&mut fds, Some(&rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 })).unwrap();
    fds[0].revents().intersects(rustix::event::PollFlags::HUP | rustix::event::PollFlags::ERR)
}

#[test]
fn a_taker_beyond_the_kept_connections_is_served_and_the_one_idle_longest_goes() {
    raise_fd_limit();
    let f = unsafe { OwnedFd::from_raw_fd(libc::memfd_create(c"takers".as_ptr(), libc::MFD_CLOEXEC)) };
    let first = offer().unwrap();
    add(&first, &[f.as_raw_fd()], 1).unwrap();
    // This process's own taker connection is the oldest: it took a handover first.
    assert_eq!(take(&first).unwrap().0.len(), 1);
    let addr = SocketAddr::from_abstract_name(&first[KEY_BYTES..]).unwrap();
    // 1,023 idle takers fill the kept connections; the next one closes the oldest idle
    // one, this process's taker connection, and itself is kept. Each asks for a handover
    // that does not exist and reads the answer, so the thread has accepted it (a connection
    // still queued on the listener is not yet kept) and it is idle from then on, in order.
    let idle: Vec<UnixStream> = (0..1024)
        .map(|i| {
            let mut s = UnixStream::connect_addr(&addr).expect("a connection");
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            s.write_all(&[0xa5u8; KEY_BYTES]).unwrap();
            let mut header = [0u8; 12];
            s.read_exact(&mut header).unwrap_or_else(|e| panic!("idle taker {i}: no answer: {e}"));
            assert_eq!(u32::from_le_bytes(header[..4].try_into().unwrap()), 1, "idle taker {i}: \"no such handover\"");
            s
        })
        .collect();
    let second = offer().unwrap();
    add(&second, &[f.as_raw_fd()], 1).unwrap();
    // The taker finds its kept connection closed and connects anew: served, not refused.
    let (got, sends) = take(&second).expect("a taker beyond the kept connections is served");
    assert_eq!((got.len(), sends), (1, 1));
    // Its new connection closed the idle one that waited longest, and no other.
    let mut closed = Vec::new();
    for _ in 0..100 {
        closed = idle.iter().enumerate().filter(|(_, s)| hung_up(s)).map(|(i, _)| i).collect();
        if !closed.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(closed, vec![0], "the idle connection made first goes");
}

#[test]
fn a_request_the_sender_closed_unread_goes_again_on_a_new_connection() {
    // A stand-in sender: its first connection is closed with the request unread (as the
    // thread closes the connection idle longest), its second answers "no such handover".
    let name = format!("gpupool-handover-test-{}", std::process::id());
    let listener = UnixListener::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
    let server = std::thread::spawn(move || {
        let (first, _) = listener.accept().unwrap();
        // Wait for the request to be there, then close without reading it.
        let mut fds = [rustix::event::PollFd::new(&first, rustix::event::PollFlags::IN)];
        rustix::event::poll(&mut fds, None).unwrap();
        drop(first);
        let (mut second, _) = listener.accept().unwrap();
        let mut key = [0u8; KEY_BYTES];
        second.read_exact(&mut key).unwrap();
        let mut unknown = [0u8; 12];
        unknown[..4].copy_from_slice(&1u32.to_le_bytes());
        second.write_all(&unknown).unwrap();
        let _ = second.as_fd();
        key
    });
    let mut ticket = vec![7u8; KEY_BYTES];
    ticket.extend_from_slice(name.as_bytes());
    let err = take(&ticket).expect_err("the stand-in has no handover").to_string();
    assert!(err.contains("has no such handover"), "the request reached the second connection: {err}");
    assert_eq!(server.join().unwrap(), [7u8; KEY_BYTES], "the same request, sent again");
}
