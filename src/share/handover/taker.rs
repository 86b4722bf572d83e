//! The receiver's side of the handover: one kept connection per sender, a request and its
//! answer per handover.
//!
//! A connection whose exchange failed midway is closed and forgotten before its lock is
//! let go, so a thread waiting on it connects anew instead of reading the rest of another's
//! answer. The sender is checked to be this user (or root) when connecting: an abstract name
//! can be bound by anyone once its owner is gone. Connections to senders that hung up are
//! dropped when a new one is made, and a request that cannot be written on a kept
//! connection, or that the sender closed without answering at all (it closes the
//! connection idle longest when it has too many: it reached nothing), goes once more on a
//! new one.

use super::{wire, KEY_BYTES};
use crate::error::Error;
use rustix::event::{PollFd, PollFlags};
use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long a taker waits for a sender's answer: the sender's thread answers at once, so
/// only a sender that stopped (a debugger, a hung machine) takes this long.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(120);
/// More descriptors than any handover carries (a count beyond it is a broken stream).
const MAX_COUNT: u32 = 1 << 22;

/// A kept connection: `None` once an exchange on it failed (the next take reconnects).
type Kept = Arc<Mutex<Option<UnixStream>>>;

/// The kept connections by sender socket name, and the process they belong to (a `fork()`
/// child must not talk over its parent's streams).
pub(super) static CONNECTIONS: Mutex<Option<Connections>> = Mutex::new(None);

/// (owning process, kept connection by sender socket name).
pub(super) type Connections = (u32, HashMap<Vec<u8>, Kept>);

pub(super) enum Exchange {
    /// The sender does not have it (taken already, withdrawn, never offered).
    Unknown,
    /// This process cannot hold the descriptors (its open-file limit).
    FdLimit(u32),
    /// The connection failed midway, or could not be made.
    Broken(std::io::Error),
    /// The request could not be written: the sender's side of a kept connection is closed
    /// (it dropped the connection, or ended). Nothing was asked of it: worth one retry on a
    /// new connection.
    NotSent(std::io::Error),
}

impl Exchange {
    pub(super) fn into_error(self, name: &[u8]) -> Error {
        let who = String::from_utf8_lossy(name);
        match self {
            Exchange::Unknown => Error::InvalidArgument(format!(
                "handover: {who} has no such handover: a shared block's descriptors are taken once (by the process that \
                 unpickles its message), and a message that was never sent is withdrawn"
            )),
            Exchange::FdLimit(n) => Error::InvalidArgument(format!(
                "handover: receiving {n} descriptors from {who} needs more open files than this process may have; \
                 raise the limit (ulimit -n)"
            )),
            Exchange::Broken(e) | Exchange::NotSent(e) => Error::InvalidArgument(format!(
                "handover: the process that shared this block is gone or stopped answering ({who}: {e}); a block can \
                 be received only while its sender lives"
            )),
        }
    }
}

/// The kept connection to `name` (made, outside the table's lock, if there is none).
fn kept(name: &[u8]) -> std::result::Result<Kept, Exchange> {
    let pid = std::process::id();
    {
        let mut conns = CONNECTIONS.lock().map_err(|_| Exchange::Broken(std::io::Error::other("a lock is poisoned")))?;
        if conns.as_ref().is_some_and(|(owner, _)| *owner != pid) {
            *conns = None; // a fork() child's copies of its parent's streams: closed here only
        }
        if let Some(c) = conns.as_ref().and_then(|(_, m)| m.get(name)) {
            return Ok(c.clone());
        }
    }
    let addr = SocketAddr::from_abstract_name(name).map_err(Exchange::Broken)?;
    let stream = UnixStream::connect_addr(&addr).map_err(Exchange::Broken)?;
    if !super::server::same_user(&stream) {
        return Err(Exchange::Broken(std::io::Error::other("the socket is another user's")));
    }
    stream.set_read_timeout(Some(ANSWER_TIMEOUT)).map_err(Exchange::Broken)?;
    stream.set_write_timeout(Some(ANSWER_TIMEOUT)).map_err(Exchange::Broken)?;
    let mut conns = CONNECTIONS.lock().map_err(|_| Exchange::Broken(std::io::Error::other("a lock is poisoned")))?;
    let (_, map) = conns.get_or_insert_with(|| (pid, HashMap::new()));
    map.retain(|_, c| alive(c));
    Ok(map.entry(name.to_vec()).or_insert_with(|| Arc::new(Mutex::new(Some(stream)))).clone())
}

/// Whether a kept connection may still serve: not failed, and its sender has not hung up
/// (one another thread is using counts as alive).
fn alive(c: &Kept) -> bool {
    let Ok(guard) = c.try_lock() else { return true };
    let Some(s) = guard.as_ref() else { return false };
    let mut fds = [PollFd::new(s, PollFlags::IN)];
    match rustix::event::poll(&mut fds, Some(&rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 })) {
        Ok(_) => !fds[0].revents().intersects(PollFlags::HUP | PollFlags::ERR),
        Err(_) => true,
    }
}

/// Take the handover `key` from the sender at `name`.
pub(super) fn take_from(name: &[u8], key: &[u8; KEY_BYTES]) -> std::result::Result<(Vec<OwnedFd>, u32), Exchange> {
    let mut retried = false;
    loop {
        let conn = kept(name)?;
        let mut guard = conn.lock().map_err(|_| Exchange::Broken(std::io::Error::other("a lock is poisoned")))?;
        let Some(stream) = guard.as_mut() else {
            // Failed under another thread while this one waited: forget it, connect anew.
            drop(guard);
            forget(name, &conn);
            continue;
        };
        let got = exchange(stream, key);
        if let Err(Exchange::Broken(_) | Exchange::NotSent(_)) = &got {
            // Closed before the lock goes, so no waiting thread reads the rest of this answer.
            let _ = stream.shutdown(std::net::Shutdown::Both);
            *guard = None;
            drop(guard);
            forget(name, &conn);
        }
        match got {
            Err(Exchange::NotSent(_)) if !retried => retried = true, // on a new connection
            Err(Exchange::NotSent(e)) => return Err(Exchange::Broken(e)),
            got => return got,
        }
    }
}

fn forget(name: &[u8], conn: &Kept) {
    if let Ok(mut c) = CONNECTIONS.lock() {
        if let Some((_, map)) = c.as_mut() {
            if map.get(name).is_some_and(|k| Arc::ptr_eq(k, conn)) {
                map.remove(name);
            }
        }
    }
}

fn exchange(stream: &mut UnixStream, key: &[u8; KEY_BYTES]) -> std::result::Result<(Vec<OwnedFd>, u32), Exchange> {
    crate::socket::send_all(stream, key).map_err(Exchange::NotSent)?;
    let (status, count, sends) = wire::read_header(stream).map_err(|e| {
        // Closed with no byte of an answer: the sender dropped this connection (it keeps
        // at most so many, closing the one idle longest) without reading the request, which
        // it answers whole once read. Nothing was taken: worth the one retry.
        if e.kind() == std::io::ErrorKind::UnexpectedEof && wire::nothing_read(&e) {
            Exchange::NotSent(e)
        } else {
            Exchange::Broken(e)
        }
    })?;
    match status {
        wire::FOUND => {}
        wire::UNKNOWN => return Err(Exchange::Unknown),
        other => return Err(Exchange::Broken(std::io::Error::other(format!("an answer of status {other}")))),
    }
    if count > MAX_COUNT {
        return Err(Exchange::Broken(std::io::Error::other(format!("an answer of {count} descriptors"))));
    }
    let eof = || Exchange::Broken(std::io::ErrorKind::UnexpectedEof.into());
    let mut fds = Vec::with_capacity(count as usize);
    while fds.len() < count as usize {
        let (got, truncated) = wire::recv_fds(stream).map_err(Exchange::Broken)?.ok_or_else(eof)?;
        if truncated {
            // The handover is lost either way: read the rest of the answer off the stream
            // so it stays usable (what arrives closes at once).
            let messages = (count as usize).div_ceil(wire::PER_MESSAGE);
            let read = fds.len().div_ceil(wire::PER_MESSAGE) + 1;
            for _ in read..messages {
                wire::recv_fds(stream).map_err(Exchange::Broken)?.ok_or_else(eof)?;
            }
            return Err(Exchange::FdLimit(count));
        }
        if got.is_empty() {
            return Err(Exchange::Broken(std::io::Error::other("a message came without its descriptors")));
        }
        fds.extend(got);
    }
    Ok((fds, sends))
}
