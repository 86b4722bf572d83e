//! Handing file descriptors to another process from the library, with no interpreter on
//! either side: the transport of the frameworks' process-sharing routes
//! (`python/gpupool/share.py`).
//!
//! Why: a shared arena block is its memory's file descriptors, which only a Unix socket
//! (`SCM_RIGHTS`) can carry between processes that may not ptrace each other. Python's
//! multiprocessing has a thread that hands descriptors over (its resource sharer), but
//! every handover there is a new connection with an authentication handshake, answered by
//! a Python thread that needs the sender's interpreter lock while the sender is busy
//! pickling the next message: about 2.5 ms a handover, measured on the consumer. Here a
//! thread of the library answers, and a receiver keeps its connection to each sender for
//! the next handover.
//!
//! The sender (`offer`, `add`) registers a *handover*: descriptors (the library's own
//! copies) under a random 16-byte key, for exactly one taker. Its *ticket* (the key and
//! the sender's socket name) travels inside the message; whoever unpickles the message
//! `take`s the handover with it, once. The socket is in the abstract namespace (nothing on
//! disk to clean up), served by one thread of the library, and refuses peers of another user (`SO_PEERCRED`; root may connect),
//! so what guards a handover is its key, which only the message's reader has, as the
//! multiprocessing authkey guards the resource sharer. A handover nobody takes stays until
//! it is withdrawn or the sender exits, as in the resource sharer.
//!
//! Wire protocol, per request on a kept connection: the taker writes the 16-byte key; the
//! sender answers `status, count, sends` (three little-endian `u32`: status 0 found, 1
//! unknown: taken already, withdrawn or never offered) and then, when found, the
//! descriptors in messages of at most `PER_MESSAGE`, each one byte of data with its
//! descriptors attached.

use crate::error::{Error, Result};
use rustix::event::{PollFd, PollFlags};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer, SendAncillaryMessage,
    SendFlags,
};
use std::collections::HashMap;
use std::io::{IoSlice, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// Bytes of a handover's key.
pub const KEY_BYTES: usize = 16;
/// Descriptors per `SCM_RIGHTS` message (the kernel takes at most 253).
const PER_MESSAGE: usize = 250;
/// How long a taker waits for a sender's answer: the sender's thread answers at once, so
/// only a sender that stopped (a debugger, a hung machine) takes this long.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(120);

const FOUND: u32 = 0;
const UNKNOWN: u32 = 1;

/// One handover: the sender's copies of its descriptors and how many sends name them.
struct Handover {
    fds: Vec<OwnedFd>,
    sends: u32,
}

/// Descriptors the table of this process's open files is grown to hold at once (a few
/// handovers' worth of a large tensor's granules).
const FD_TABLE: u64 = 16384;

/// This process's handovers not taken yet, by key.
static WAITING: Mutex<Option<HashMap<[u8; KEY_BYTES], Handover>>> = Mutex::new(None);
/// This process's socket name (abstract), once its thread listens; or why it could not.
static SERVER: OnceLock<std::result::Result<Vec<u8>, String>> = OnceLock::new();
/// The process that started the server: a `fork()` child has no thread serving its
/// copy of the socket, so it offers nothing (`spawn` children start their own).
static SERVER_PID: OnceLock<u32> = OnceLock::new();
/// The taker's kept connections, by sender socket name, and the process they belong to (a
/// `fork()` child must not talk over its parent's streams).
static CONNECTIONS: Mutex<Option<(u32, Connections)>> = Mutex::new(None);

/// Kept connections by sender socket name.
type Connections = HashMap<Vec<u8>, Arc<Mutex<UnixStream>>>;

fn random<const N: usize>() -> Result<[u8; N]> {
    let mut out = [0u8; N];
    let mut got = 0;
    while got < N {
        // SAFETY: writes at most N - got bytes into `out` from `got` on.
        let n = unsafe { libc::getrandom(out[got..].as_mut_ptr().cast(), N - got, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::Internal(format!("handover: getrandom failed: {e}")));
        }
        got += n as usize;
    }
    Ok(out)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The listening socket's name, starting its thread the first time.
fn server() -> Result<&'static [u8]> {
    let pid = std::process::id();
    if *SERVER_PID.get_or_init(|| pid) != pid {
        return Err(Error::Stopped(
            "handover: a fork() child cannot share blocks (its parent's thread serves the socket it inherited); start \
             child processes with spawn or forkserver"
                .into(),
        ));
    }
    let started = SERVER.get_or_init(|| {
        let tag = random::<8>().map_err(|e| e.to_string())?;
        let name = format!("gpupool-handover-{}-{}", std::process::id(), hex(&tag)).into_bytes();
        let addr = SocketAddr::from_abstract_name(&name).map_err(|e| e.to_string())?;
        let listener = UnixListener::bind_addr(&addr).map_err(|e| format!("cannot listen: {e}"))?;
        listener.set_nonblocking(true).map_err(|e| format!("cannot listen: {e}"))?;
        std::thread::Builder::new()
            .name("gpupool-handover".into())
            .spawn(move || serve(listener))
            .map_err(|e| format!("cannot start its thread: {e}"))?;
        Ok(name)
    });
    match started {
        Ok(name) => Ok(name),
        Err(why) => Err(Error::Internal(format!("handover: the descriptor server is not running: {why}"))),
    }
}

/// Whether `conn`'s peer may take handovers: the same user, or root.
fn peer_allowed(conn: &UnixStream) -> bool {
    match rustix::net::sockopt::socket_peercred(conn) {
        Ok(cred) => {
            let uid = cred.uid.as_raw();
            // SAFETY: geteuid cannot fail.
            uid == 0 || uid == unsafe { libc::geteuid() }
        }
        Err(_) => false,
    }
}

/// The descriptor thread: accept takers and answer their requests, all on this one thread
/// (a request is a lookup and a few `sendmsg`; a thread started per taker cost milliseconds
/// in a process the size of a CUDA program's, paid by the taker's first handover).
fn serve(listener: UnixListener) {
    let mut takers: Vec<UnixStream> = Vec::new();
    loop {
        let ready: Vec<(bool, bool)> = {
            let mut fds = Vec::with_capacity(takers.len() + 1);
            fds.push(PollFd::new(&listener, PollFlags::IN));
            fds.extend(takers.iter().map(|t| PollFd::new(t, PollFlags::IN)));
            match rustix::event::poll(&mut fds, None) {
                Ok(_) => {}
                Err(e) if e == rustix::io::Errno::INTR => continue,
                Err(_) => return,
            }
            fds.iter().map(|f| (f.revents().contains(PollFlags::IN), f.revents().intersects(PollFlags::HUP | PollFlags::ERR))).collect()
        };
        // Answer before accepting, and drop takers that hung up or misbehaved.
        let mut keep = Vec::with_capacity(takers.len());
        for (mut t, &(readable, gone)) in takers.drain(..).zip(&ready[1..]) {
            let ok = if readable { answer(&mut t).is_ok() } else { !gone };
            if ok {
                keep.push(t);
            }
        }
        takers = keep;
        if ready[0].0 {
            while let Ok((t, _)) = listener.accept() {
                // A taker that sends half a key or stops reading holds this thread up
                // for a second at most, then is dropped.
                if peer_allowed(&t)
                    && t.set_nonblocking(false).is_ok()
                    && t.set_read_timeout(Some(Duration::from_secs(1))).is_ok()
                    && t.set_write_timeout(Some(Duration::from_secs(1))).is_ok()
                {
                    takers.push(t);
                }
            }
        }
    }
}

/// Answer one request of `conn`: read a key, send its handover (or say there is none).
fn answer(conn: &mut UnixStream) -> std::io::Result<()> {
    let mut key = [0u8; KEY_BYTES];
    conn.read_exact(&mut key)?;
    let found = WAITING.lock().ok().and_then(|mut w| w.as_mut().and_then(|w| w.remove(&key)));
    // The sender's copies close after, whether or not they arrived: a handover goes once.
    match &found {
        None => write_header(conn, UNKNOWN, 0, 0),
        Some(h) => write_header(conn, FOUND, h.fds.len() as u32, h.sends).and_then(|()| send_fds(conn, &h.fds)),
    }
}

fn write_header(conn: &mut UnixStream, status: u32, count: u32, sends: u32) -> std::io::Result<()> {
    let mut b = [0u8; 12];
    b[..4].copy_from_slice(&status.to_le_bytes());
    b[4..8].copy_from_slice(&count.to_le_bytes());
    b[8..].copy_from_slice(&sends.to_le_bytes());
    conn.write_all(&b)
}

fn send_fds(conn: &UnixStream, fds: &[OwnedFd]) -> std::io::Result<()> {
    for chunk in fds.chunks(PER_MESSAGE) {
        let borrowed: Vec<BorrowedFd<'_>> = chunk.iter().map(|f| f.as_fd()).collect();
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(PER_MESSAGE))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !control.push(SendAncillaryMessage::ScmRights(&borrowed)) {
            return Err(std::io::Error::other("descriptors do not fit one message"));
        }
        let n = rustix::net::sendmsg(conn, &[IoSlice::new(&[0u8])], &mut control, SendFlags::NOSIGNAL)?;
        if n != 1 {
            return Err(std::io::Error::other("short write"));
        }
    }
    Ok(())
}

/// Ready this process for handovers, early (at start-up), so that none of this lands in a
/// handover's time: the open-file limit raised to its hard limit (a block arrives with a
/// descriptor per allocation under it), and the table of open files grown once to
/// `FD_TABLE` entries. Why the second: the kernel grows the table by doubling, and in a
/// process with more than one thread each growth waits for an RCU grace period
/// (milliseconds, paid by whichever handover crosses a power of two); growing it once at
/// start-up pays that once. `serve`: also start the descriptor thread (a process that
/// sends).
pub fn prepare(serve: bool) -> Result<()> {
    crate::upstream::shared::raise_fd_limit();
    static TABLE: std::sync::Once = std::sync::Once::new();
    TABLE.call_once(grow_fd_table);
    if serve {
        server()?;
    }
    Ok(())
}

fn grow_fd_table() {
    let mut l = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: a writable struct.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) } != 0 {
        return;
    }
    let top = l.rlim_cur.min(FD_TABLE).saturating_sub(1);
    if top < 64 {
        return;
    }
    // A copy at the top number makes the kernel size the table for it; closing the copy
    // leaves the table as large (it never shrinks).
    if let Ok(null) = std::fs::File::open("/dev/null") {
        use std::os::fd::AsRawFd;
        // SAFETY: F_DUPFD_CLOEXEC of an open descriptor; the copy is closed at once.
        let copy = unsafe { libc::fcntl(null.as_raw_fd(), libc::F_DUPFD_CLOEXEC, top as libc::c_int) };
        if copy >= 0 {
            unsafe { libc::close(copy) };
        }
    }
}

/// The length of this process's tickets (starting its server).
pub fn ticket_len() -> Result<usize> {
    Ok(KEY_BYTES + server()?.len())
}

/// A new handover of this process, empty: its ticket (the key, then the socket name).
pub fn offer() -> Result<Vec<u8>> {
    prepare(false)?;
    let name = server()?;
    let key = random::<KEY_BYTES>()?;
    let mut waiting = WAITING.lock().map_err(|_| Error::Internal("handover: the table's lock is poisoned".into()))?;
    waiting.get_or_insert_with(HashMap::new).insert(key, Handover { fds: Vec::new(), sends: 0 });
    let mut ticket = key.to_vec();
    ticket.extend_from_slice(name);
    Ok(ticket)
}

fn key_of(ticket: &[u8]) -> Result<[u8; KEY_BYTES]> {
    if ticket.len() <= KEY_BYTES {
        return Err(Error::InvalidArgument(format!("handover: a ticket is longer than {KEY_BYTES} bytes, got {}", ticket.len())));
    }
    let mut key = [0u8; KEY_BYTES];
    key.copy_from_slice(&ticket[..KEY_BYTES]);
    Ok(key)
}

/// Add copies of `fds` (which stay the caller's) to this process's handover `ticket`, and
/// `sends` to the count of sends that name it (the taker learns both).
pub fn add(ticket: &[u8], fds: &[RawFd], sends: u32) -> Result<()> {
    let key = key_of(ticket)?;
    let mut copies = Vec::with_capacity(fds.len());
    for &fd in fds {
        // SAFETY: F_DUPFD_CLOEXEC on a caller's descriptor; a bad one fails with EBADF.
        let c = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
        if c < 0 {
            let e = std::io::Error::last_os_error();
            return Err(Error::InvalidArgument(format!("handover: descriptor {fd} cannot be copied: {e}")));
        }
        // SAFETY: `c` is a new descriptor this function owns.
        copies.push(unsafe { OwnedFd::from_raw_fd(c) });
    }
    let mut waiting = WAITING.lock().map_err(|_| Error::Internal("handover: the table's lock is poisoned".into()))?;
    let Some(h) = waiting.as_mut().and_then(|w| w.get_mut(&key)) else {
        return Err(Error::InvalidArgument("handover: no such handover of this process (taken, withdrawn or never offered)".into()));
    };
    h.fds.extend(copies);
    h.sends = h.sends.saturating_add(sends);
    Ok(())
}

/// Withdraw this process's handover `ticket` (its message was never sent): its copies
/// close. Whether it was still there.
pub fn withdraw(ticket: &[u8]) -> Result<bool> {
    let key = key_of(ticket)?;
    let removed = WAITING.lock().ok().and_then(|mut w| w.as_mut().and_then(|w| w.remove(&key)));
    Ok(removed.is_some())
}

/// Take handover `ticket` from the process that offered it: its descriptors (this
/// process's, in the order they were added) and how many sends name them.
pub fn take(ticket: &[u8]) -> Result<(Vec<OwnedFd>, u32)> {
    let key = key_of(ticket)?;
    prepare(false)?;
    let name = ticket[KEY_BYTES..].to_vec();
    let conn = connection(&name)?;
    let mut stream = conn.lock().map_err(|_| Error::Internal("handover: a connection's lock is poisoned".into()))?;
    let got = exchange(&mut stream, &key);
    if matches!(got, Err(Exchange::Broken(_))) {
        // Whatever state the stream is in, the next take starts on a new one.
        if let Ok(mut c) = CONNECTIONS.lock() {
            if let Some((_, c)) = c.as_mut() {
                if c.get(&name).is_some_and(|kept| Arc::ptr_eq(kept, &conn)) {
                    c.remove(&name);
                }
            }
        }
    }
    got.map_err(|e| e.into_error(&name))
}

enum Exchange {
    /// The sender does not have it (taken already, withdrawn, never offered).
    Unknown,
    /// This process cannot hold the descriptors (its open-file limit).
    FdLimit(u32),
    /// The connection failed midway.
    Broken(std::io::Error),
}

impl Exchange {
    fn into_error(self, name: &[u8]) -> Error {
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
            Exchange::Broken(e) => Error::InvalidArgument(format!(
                "handover: the process that shared this block is gone or stopped answering ({who}: {e}); a block can \
                 be received only while its sender lives"
            )),
        }
    }
}

/// A kept connection to `name`, made if there is none.
fn connection(name: &[u8]) -> Result<Arc<Mutex<UnixStream>>> {
    let mut conns = CONNECTIONS.lock().map_err(|_| Error::Internal("handover: the connections' lock is poisoned".into()))?;
    let pid = std::process::id();
    if conns.as_ref().is_some_and(|(owner, _)| *owner != pid) {
        *conns = None; // a fork() child's copies of its parent's streams: closed here only
    }
    let (_, conns) = conns.get_or_insert_with(|| (pid, HashMap::new()));
    if let Some(c) = conns.get(name) {
        return Ok(c.clone());
    }
    let who = String::from_utf8_lossy(name).into_owned();
    let addr = SocketAddr::from_abstract_name(name)
        .map_err(|e| Error::InvalidArgument(format!("handover: bad socket name {who}: {e}")))?;
    let stream = UnixStream::connect_addr(&addr).map_err(|e| {
        Error::InvalidArgument(format!(
            "handover: the process that shared this block is gone (cannot reach {who}: {e}), or is in another network \
             namespace"
        ))
    })?;
    let _ = stream.set_read_timeout(Some(ANSWER_TIMEOUT));
    let c = Arc::new(Mutex::new(stream));
    conns.insert(name.to_vec(), c.clone());
    Ok(c)
}

fn exchange(stream: &mut UnixStream, key: &[u8; KEY_BYTES]) -> std::result::Result<(Vec<OwnedFd>, u32), Exchange> {
    stream.write_all(key).map_err(Exchange::Broken)?;
    let mut header = [0u8; 12];
    stream.read_exact(&mut header).map_err(Exchange::Broken)?;
    let word = |i: usize| u32::from_le_bytes(header[i..i + 4].try_into().unwrap_or_default());
    let (status, count, sends) = (word(0), word(4), word(8));
    if status != FOUND {
        return Err(Exchange::Unknown);
    }
    let mut fds = Vec::with_capacity(count as usize);
    let mut truncated = false;
    while fds.len() < count as usize {
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(PER_MESSAGE))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let mut byte = [0u8; 1];
        let got = rustix::net::recvmsg(stream.as_fd(), &mut [IoSliceMut::new(&mut byte)], &mut control, RecvFlags::CMSG_CLOEXEC)
            .map_err(|e| Exchange::Broken(e.into()))?;
        if got.bytes == 0 {
            return Err(Exchange::Broken(std::io::Error::from(std::io::ErrorKind::UnexpectedEof)));
        }
        let before = fds.len();
        for msg in control.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = msg {
                fds.extend(received);
            }
        }
        if got.flags.contains(ReturnFlags::CTRUNC) {
            // The kernel dropped what did not fit (this process's open-file limit): the
            // handover is lost either way; read the rest off the stream so it stays usable.
            truncated = true;
            fds.truncate(before);
            let remaining = (count as usize).saturating_sub(before);
            for _ in 0..remaining.div_ceil(PER_MESSAGE).saturating_sub(1) {
                let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(PER_MESSAGE))];
                let mut control = RecvAncillaryBuffer::new(&mut space);
                rustix::net::recvmsg(stream.as_fd(), &mut [IoSliceMut::new(&mut byte)], &mut control, RecvFlags::CMSG_CLOEXEC)
                    .map_err(|e| Exchange::Broken(e.into()))?;
                control.drain().for_each(drop); // closes what did arrive
            }
            break;
        }
        if fds.len() == before {
            return Err(Exchange::Broken(std::io::Error::other("a message came without its descriptors")));
        }
    }
    if truncated {
        return Err(Exchange::FdLimit(count));
    }
    Ok((fds, sends))
}

#[cfg(test)]
mod tests;
