//! The handover's wire format, both sides: a request is a 16-byte key; an answer is
//! `status, count, sends` (three little-endian `u32`: status `FOUND`, or `UNKNOWN`: taken
//! already, withdrawn or never offered) and then, when found, the descriptors in messages
//! of at most `PER_MESSAGE`, each one byte of data with its descriptors attached
//! (`SCM_RIGHTS`). Every call here retries when a signal interrupts it: a handler installed
//! without `SA_RESTART` (CPython's are) must not cut an answer in two.

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer, SendAncillaryMessage,
    SendFlags,
};
use std::io::{ErrorKind, IoSlice, IoSliceMut, Read};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

/// Descriptors per `SCM_RIGHTS` message (the kernel takes at most 253).
pub const PER_MESSAGE: usize = 250;
pub const FOUND: u32 = 0;
pub const UNKNOWN: u32 = 1;

pub fn write_header(conn: &UnixStream, status: u32, count: u32, sends: u32) -> std::io::Result<()> {
    let mut b = [0u8; 12];
    b[..4].copy_from_slice(&status.to_le_bytes());
    b[4..8].copy_from_slice(&count.to_le_bytes());
    b[8..].copy_from_slice(&sends.to_le_bytes());
    crate::socket::send_all(conn, &b)
}

/// What `read_header` says of a connection closed before any byte of the answer.
const NOTHING_READ: &str = "the connection closed before any answer";

/// `(status, count, sends)`. A connection closed (or reset) before the first byte is an
/// `UnexpectedEof` that `nothing_read` recognises; one closed midway, a plain one.
pub fn read_header(conn: &mut UnixStream) -> std::io::Result<(u32, u32, u32)> {
    let mut b = [0u8; 12];
    let mut got = 0;
    while got < b.len() {
        match conn.read(&mut b[got..]) {
            Ok(0) if got == 0 => return Err(std::io::Error::new(ErrorKind::UnexpectedEof, NOTHING_READ)),
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            // The sender closed with the request unread in its queue: the kernel says reset.
            Err(e) if e.kind() == ErrorKind::ConnectionReset && got == 0 => {
                return Err(std::io::Error::new(ErrorKind::UnexpectedEof, NOTHING_READ))
            }
            Err(e) => return Err(e),
        }
    }
    let word = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    Ok((word(0), word(4), word(8)))
}

/// Whether `e` (from `read_header`) is a connection closed before any byte of the answer.
pub fn nothing_read(e: &std::io::Error) -> bool {
    e.kind() == ErrorKind::UnexpectedEof && e.get_ref().is_some_and(|m| m.to_string() == NOTHING_READ)
}

pub fn send_fds(conn: &UnixStream, fds: &[OwnedFd]) -> std::io::Result<()> {
    for chunk in fds.chunks(PER_MESSAGE) {
        let borrowed: Vec<BorrowedFd<'_>> = chunk.iter().map(|f| f.as_fd()).collect();
        loop {
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(PER_MESSAGE))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            if !control.push(SendAncillaryMessage::ScmRights(&borrowed)) {
                return Err(std::io::Error::other("descriptors do not fit one message"));
            }
            match rustix::net::sendmsg(conn, &[IoSlice::new(&[0u8])], &mut control, SendFlags::NOSIGNAL) {
                Ok(1) => break,
                Ok(_) => return Err(std::io::Error::other("short write")),
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(())
}

/// One message of descriptors: `Ok(None)` at the end of the stream; `truncated` when the
/// kernel dropped some (this process's open-file limit): those that did arrive are closed.
pub fn recv_fds(conn: &UnixStream) -> std::io::Result<Option<(Vec<OwnedFd>, bool)>> {
    loop {
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(PER_MESSAGE))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let mut byte = [0u8; 1];
        let got = match rustix::net::recvmsg(conn.as_fd(), &mut [IoSliceMut::new(&mut byte)], &mut control, RecvFlags::CMSG_CLOEXEC) {
            Ok(got) => got,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        };
        if got.bytes == 0 {
            return Ok(None);
        }
        let mut fds = Vec::new();
        for msg in control.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = msg {
                fds.extend(received);
            }
        }
        if got.flags.contains(ReturnFlags::CTRUNC) {
            return Ok(Some((Vec::new(), true))); // `fds` closes here
        }
        return Ok(Some((fds, false)));
    }
}
