//! Handing file descriptors to another process from the library, with no interpreter on
//! either side: the transport of the frameworks' process-sharing routes
//! (`python/gpupool/share.py`).
//!
//! Why: a shared arena block is its memory's file descriptors, which only a Unix socket
//! (`SCM_RIGHTS`) can carry between processes that may not ptrace each other. Python's
//! multiprocessing has a thread that hands descriptors over (its resource sharer), but
//! every handover there is a new connection with an authentication handshake, answered by
//! a Python thread that needs the sender's interpreter lock while the sender is busy
//! pickling the next message (milliseconds a handover; docs/ipc.md points to the figures). Here a
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
//! - `server.rs`: the sender's thread; `taker.rs`: the receiver's kept connections;
//!   `wire.rs`: what goes over them.
//! - A `fork()` child closes its copies of all of it (`fork_child`): it would otherwise
//!   keep the parent's socket name bound and its takers' connections open after the
//!   parent is gone (takers would wait instead of being told), and the parent's pending
//!   descriptors alive.

use crate::error::{Error, Result};
use std::cell::RefCell;
use std::collections::HashMap;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::sync::{Mutex, MutexGuard, Once};

mod server;
mod taker;
mod wire;

/// Bytes of a handover's key.
pub const KEY_BYTES: usize = 16;

/// Descriptors the table of this process's open files is grown to hold at once (a few
/// handovers' worth of a large tensor's granules).
const FD_TABLE: u64 = 16384;

/// One handover: the sender's copies of its descriptors and how many sends name them.
struct Handover {
    fds: Vec<OwnedFd>,
    sends: u32,
}

/// This process's handovers not taken yet, by key.
static WAITING: Mutex<Option<HashMap<[u8; KEY_BYTES], Handover>>> = Mutex::new(None);

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

/// Ready this process for handovers, early (at start-up), so that none of this lands in a
/// handover's time: the open-file limit raised to its hard limit (a block arrives with a
/// descriptor per allocation under it), and the table of open files grown once to
/// `FD_TABLE` entries. Why the second: the kernel grows the table by doubling, and in a
/// process with more than one thread each growth waits for an RCU grace period
/// (milliseconds, paid by whichever handover crosses a power of two); growing it once at
/// start-up pays that once. `serve`: also start the descriptor thread (a process that
/// sends).
pub fn prepare(serve: bool) -> Result<()> {
    crate::share::protocol::raise_fd_limit();
    static TABLE: std::sync::Once = std::sync::Once::new();
    TABLE.call_once(grow_fd_table);
    if serve {
        server::name()?;
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

/// The length of this process's tickets (starting its descriptor thread).
pub fn ticket_len() -> Result<usize> {
    Ok(KEY_BYTES + server::name()?.0.len())
}

/// The abstract socket name of process `pid`'s descriptor thread, whose name's random part
/// is `tag` (it keeps another local process from binding a name the sender will want).
fn socket_name(pid: u32, tag: u64) -> Vec<u8> {
    format!("gpupool-handover-{pid}-{tag:016x}").into_bytes()
}

/// The random part of this process's socket name, starting its descriptor thread; `0`
/// where it cannot serve (a `fork()` child, a thread that could not start): what an arena
/// export names so that an importer refused `pidfd_getfd` can ask this process instead.
pub fn export_tag() -> u64 {
    server::name().map_or(0, |(_, tag)| tag)
}

/// The first bytes of a request for an export's descriptors (`take_export`), before its
/// record slot and token. A random handover key that begins so is looked up as a handover
/// first, and a token is 64 random bits: the two cannot be mistaken for each other.
const EXPORT_KEY: &[u8; 4] = b"GPXR";

fn export_key(slot: u32, token: u64) -> [u8; KEY_BYTES] {
    let mut key = [0u8; KEY_BYTES];
    key[..4].copy_from_slice(EXPORT_KEY);
    key[4..8].copy_from_slice(&slot.to_le_bytes());
    key[8..].copy_from_slice(&token.to_le_bytes());
    key
}

fn export_of_key(key: &[u8; KEY_BYTES]) -> Option<(u32, u64)> {
    (key[..4] == EXPORT_KEY[..]).then(|| {
        (u32::from_le_bytes(key[4..8].try_into().expect("4 bytes")), u64::from_le_bytes(key[8..].try_into().expect("8 bytes")))
    })
}

/// This process's copies of the descriptors behind the arena export `d`, asked of its
/// exporter's descriptor thread: each of the exporter's numbers once, in the order the
/// descriptor first names it (`GranuleDescriptor::per_granule` takes that list), after `d` was
/// checked against the exporter's record, which comes with them (`protocol::check_handed`),
/// the exporter's opens file, where an import of the block is counted while open, and the
/// record (to check again once the import is counted).
/// The exporter answers only while it records the export (its token live), and only to a
/// peer of its own user: the route for an importer that may not copy them with
/// `pidfd_getfd` (a container's seccomp profile, Yama), which needs no ptrace right.
/// `refused` says why this process may not copy them itself, for the error where the
/// thread does not hand them over either.
pub fn take_export(
    d: &crate::share::protocol::GranuleDescriptor,
    refused: &str,
) -> Result<(Vec<OwnedFd>, Option<OwnedFd>, crate::share::protocol::Fd)> {
    if d.handover == 0 {
        return Err(Error::InvalidArgument(format!(
            "{refused}; process {} exported the block without a handover socket (a fork() child, or its descriptor \
             thread could not start): pass the descriptors yourself, received over a Unix socket",
            d.pid
        )));
    }
    crate::share::protocol::still_the_exporter(d)?;
    prepare(false)?;
    on_fork_once();
    let name = socket_name(d.pid, d.handover);
    match taker::take_from(&name, &export_key(d.record.slot, d.record.token)) {
        Ok((mut fds, _)) if fds.len() >= 2 => {
            let record = crate::share::protocol::check_handed(d, fds.remove(0))?;
            // The exporter's opens file comes last (`ExportRecord::handed`).
            let opens = fds.pop();
            Ok((fds, opens, record))
        }
        Ok(_) => Err(Error::InvalidArgument(format!("IPC import: process {} handed over no export record", d.pid))),
        Err(taker::Exchange::Unknown) => Err(Error::InvalidArgument(format!(
            "IPC import: process {} no longer exports this block (the descriptor is stale: the block was freed, or its \
             memory released, after the export)",
            d.pid
        ))),
        Err(e) => Err(Error::InvalidArgument(format!(
            "{refused}; nor did its handover thread hand them over ({}; it answers processes of its own user only): pass \
             the descriptors yourself, received over a Unix socket",
            e.into_error(&name).to_string().trim_start_matches("gpupool: invalid argument: ")
        ))),
    }
}

/// A new handover of this process, empty: its ticket (the key, then the socket name).
pub fn offer() -> Result<Vec<u8>> {
    prepare(false)?;
    let (name, _) = server::name()?;
    let key = random::<KEY_BYTES>()?;
    let mut waiting = WAITING.lock().map_err(|_| Error::Internal("handover: the table's lock is poisoned".into()))?;
    waiting.get_or_insert_with(HashMap::new).insert(key, Handover { fds: Vec::new(), sends: 0 });
    let mut ticket = key.to_vec();
    ticket.extend_from_slice(name);
    Ok(ticket)
}

fn key_of(ticket: &[u8]) -> Result<[u8; KEY_BYTES]> {
    if ticket.len() <= KEY_BYTES {
        return Err(Error::InvalidArgument(format!(
            "handover: a ticket is a {KEY_BYTES}-byte key and a socket name; got {} bytes",
            ticket.len()
        )));
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
    on_fork_once();
    let name = &ticket[KEY_BYTES..];
    taker::take_from(name, &key).map_err(|e| e.into_error(name))
}

thread_local! {
    /// The handover's locks the forking thread holds between prepare and parent/child.
    static HELD: RefCell<Vec<Held>> = const { RefCell::new(Vec::new()) };
}

/// One of the handover's locks, held across a `fork()`.
enum Held {
    Waiting(MutexGuard<'static, Option<HashMap<[u8; KEY_BYTES], Handover>>>),
    Connections(MutexGuard<'static, Option<taker::Connections>>),
    ServerFds(MutexGuard<'static, Vec<(RawFd, crate::share::protocol::FileId)>>),
}

/// Register the `fork()` handlers, once per process: the forking thread takes the
/// handover's three locks (so no other thread is midway through them when memory is
/// copied); the parent lets them go; the child empties what they guard first.
fn on_fork_once() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: plain extern "C" functions that never unwind.
        unsafe { libc::pthread_atfork(Some(fork_prepare), Some(fork_parent), Some(fork_child)) };
    });
}

extern "C" fn fork_prepare() {
    let _ = std::panic::catch_unwind(|| {
        // A poisoned lock is taken anyway: the child must still be cleaned.
        let held = vec![
            Held::Waiting(WAITING.lock().unwrap_or_else(|p| p.into_inner())),
            Held::Connections(taker::CONNECTIONS.lock().unwrap_or_else(|p| p.into_inner())),
            Held::ServerFds(server::SERVER_FDS.lock().unwrap_or_else(|p| p.into_inner())),
        ];
        let _ = HELD.try_with(|h| *h.borrow_mut() = held);
    });
}

extern "C" fn fork_parent() {
    let _ = std::panic::catch_unwind(|| {
        let _ = HELD.try_with(|h| h.borrow_mut().clear());
    });
}

/// In the child: close its copies of the parent's pending descriptors, kept connections,
/// listener and takers (the parent's are untouched).
extern "C" fn fork_child() {
    let _ = std::panic::catch_unwind(|| {
        let held = HELD.try_with(|h| std::mem::take(&mut *h.borrow_mut())).unwrap_or_default();
        for g in held {
            match g {
                Held::Waiting(mut g) => *g = None,
                Held::Connections(mut g) => *g = None,
                Held::ServerFds(mut g) => {
                    for (fd, key) in g.drain(..) {
                        // Only if the number still names the server's file (never one reused).
                        if crate::share::protocol::FileId::of(fd).ok() == Some(key) {
                            // SAFETY: the child's copy of a descriptor only the (absent) server thread used.
                            unsafe { libc::close(fd) };
                        }
                    }
                }
            }
        }
    });
}

#[cfg(test)]
mod tests;
