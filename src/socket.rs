//! Socket writes that cannot kill the host program: a write to a peer that hung up raises
//! SIGPIPE, whose default action ends the process. Rust's and Python's runtimes ignore
//! SIGPIPE, C programs usually do not, and the library's sockets (the handover's, the
//! status report's) talk to other processes that may go at any moment. `MSG_NOSIGNAL`
//! turns it into `EPIPE` for that one call, without touching the process's handlers. (std's
//! `UnixStream` writes with it too, but only from Rust 1.90 on; this crate builds with 1.80.)

use std::io::ErrorKind;
use std::os::unix::net::UnixStream;

/// Write all of `b` to `conn` with `MSG_NOSIGNAL`, retrying calls a signal interrupts; a
/// write timeout set on `conn` applies to each call.
pub fn send_all(conn: &UnixStream, mut b: &[u8]) -> std::io::Result<()> {
    while !b.is_empty() {
        match rustix::net::send(conn, b, rustix::net::SendFlags::NOSIGNAL) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => b = &b[n..],
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}
