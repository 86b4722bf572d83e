//! The sender's side of the handover: one thread of the library that accepts takers on an
//! abstract Unix socket and answers their requests (a key in, the handover's descriptors
//! out), with no interpreter lock and no thread per taker.
//!
//! Why one thread for every taker: a thread started per taker cost milliseconds in a
//! process the size of a CUDA program's, paid by the taker's first handover; a request is a
//! lookup and a few `sendmsg`. What keeps one misbehaving peer of the same user (others are
//! refused) from holding it: requests are read as their bytes arrive, without waiting (a
//! taker that sends half a key delays nobody), a request must arrive whole within
//! `REQUEST_DEADLINE`, and an answer's writes time out likewise; at most `MAX_TAKERS` connections are kept (a new
//! taker beyond them closes the one idle longest, whose taker connects anew when it next
//! asks: no taker is turned away); a failing `accept` (the open-file limit) pauses the
//! listener instead of spinning. Signals
//! are blocked in the thread (a handler without `SA_RESTART`, as CPython installs them,
//! would interrupt its calls). If the thread ends anyway, `name()` says so and no new
//! handover is offered through it (the Python route falls back to multiprocessing's
//! resource sharer).

use super::{wire, KEY_BYTES, WAITING};
use crate::error::{Error, Result};
use crate::share::protocol::ExportRecord;
use crate::share::protocol::FileId;
use rustix::event::{PollFd, PollFlags};
use std::io::Read;
use std::os::fd::{AsRawFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long a taker has to send a whole request, and each write of an answer may block.
const REQUEST_DEADLINE: Duration = Duration::from_secs(1);
/// Takers kept connected at once (a consumer keeps one per sender).
const MAX_TAKERS: usize = 1024;
/// How long the listener rests after `accept` failed for a reason other than "none waiting".
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);

/// This process's socket name (abstract) and its random part, once its thread listens; or
/// why it could not.
static SERVER: OnceLock<std::result::Result<(Vec<u8>, u64), String>> = OnceLock::new();
/// The process that started the server: a `fork()` child has no thread serving its copy
/// of the socket, so it offers nothing (`spawn` children start their own).
static SERVER_PID: OnceLock<u32> = OnceLock::new();
/// Whether the thread still serves.
static SERVING: AtomicBool = AtomicBool::new(false);
/// The descriptors the thread holds (listener, takers), each with its file's identity: a
/// `fork()` child closes its copies (`super::fork_child`), or it would keep the name bound
/// and takers' connections open after the sender is gone. The list is rewritten before a
/// dropped taker closes, and the child closes a number only if it still names the same
/// file, so a number reused for something else is never closed.
pub(super) static SERVER_FDS: Mutex<Vec<(RawFd, FileId)>> = Mutex::new(Vec::new());

/// The listening socket's name and its random part, starting its thread the first time.
pub(super) fn name() -> Result<(&'static [u8], u64)> {
    let pid = std::process::id();
    if *SERVER_PID.get_or_init(|| pid) != pid {
        return Err(Error::Stopped(
            "handover: a fork() child cannot share blocks (its parent's thread serves the socket); start child \
             processes with spawn or forkserver"
                .into(),
        ));
    }
    super::on_fork_once();
    let started = SERVER.get_or_init(|| {
        let tag = u64::from_le_bytes(super::random::<8>().map_err(|e| e.to_string())?);
        let name = super::socket_name(std::process::id(), tag);
        let addr = SocketAddr::from_abstract_name(&name).map_err(|e| e.to_string())?;
        let listener = UnixListener::bind_addr(&addr).map_err(|e| format!("cannot listen: {e}"))?;
        listener.set_nonblocking(true).map_err(|e| format!("cannot listen: {e}"))?;
        SERVING.store(true, Ordering::SeqCst);
        let spawned = std::thread::Builder::new().name("gpupool-handover".into()).spawn(move || {
            block_signals();
            set_fds(&listener, &[]);
            // A panic ends the thread, not the process; either way it stops serving here.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| serve(listener)));
            SERVING.store(false, Ordering::SeqCst);
            SERVER_FDS.lock().unwrap_or_else(|p| p.into_inner()).clear();
        });
        if let Err(e) = spawned {
            SERVING.store(false, Ordering::SeqCst);
            return Err(format!("cannot start its thread: {e}"));
        }
        Ok((name, tag))
    });
    match started {
        Ok((name, tag)) if SERVING.load(Ordering::SeqCst) => Ok((name, *tag)),
        Ok(_) => Err(Error::Internal("handover: the descriptor thread stopped".into())),
        Err(why) => Err(Error::Internal(format!("handover: the descriptor server is not running: {why}"))),
    }
}

fn block_signals() {
    // SAFETY: a set filled here, applied to this thread only.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, std::ptr::null_mut());
    }
}

/// Whether `conn`'s peer is the same user, or root.
pub(super) fn same_user(conn: &UnixStream) -> bool {
    match rustix::net::sockopt::socket_peercred(conn) {
        Ok(cred) => {
            let uid = cred.uid.as_raw();
            // SAFETY: geteuid cannot fail.
            uid == 0 || uid == unsafe { libc::geteuid() }
        }
        Err(_) => false,
    }
}

fn set_fds(listener: &UnixListener, takers: &[Taker]) {
    let mut fds = SERVER_FDS.lock().unwrap_or_else(|p| p.into_inner());
    fds.clear();
    let all = std::iter::once(listener.as_raw_fd()).chain(takers.iter().map(|t| t.conn.as_raw_fd()));
    fds.extend(all.filter_map(|fd| Some((fd, FileId::of(fd).ok()?))));
}

/// A kept connection: when it last brought a request (or was accepted), and the request
/// it is sending, as far as it has arrived (read as its bytes come, so a taker that stops
/// midway holds up nobody) with when its first byte came.
struct Taker {
    conn: UnixStream,
    used: Instant,
    key: [u8; KEY_BYTES],
    got: usize,
    since: Option<Instant>,
}

impl Taker {
    /// Read what has arrived of the request: `Ok(true)` once it is whole.
    fn read_some(&mut self) -> std::io::Result<bool> {
        while self.got < KEY_BYTES {
            match self.conn.read(&mut self.key[self.got..]) {
                Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => {
                    self.since.get_or_insert_with(Instant::now);
                    self.got += n;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }

    /// Past its deadline with a request begun and not whole.
    fn late(&self, now: Instant) -> bool {
        self.since.is_some_and(|t| now >= t + REQUEST_DEADLINE)
    }
}

/// The kept connection idle longest: what a new taker beyond `MAX_TAKERS` replaces. The
/// thread serves one request at a time, so no kept connection is midway through an
/// answer here; a request its taker wrote but this thread has not read whole goes
/// unanswered, and the taker sends it again on a new connection.
fn idle_longest(takers: &[Taker]) -> usize {
    takers.iter().enumerate().min_by_key(|(_, t)| t.used).map_or(0, |(i, _)| i)
}

fn serve(listener: UnixListener) {
    let mut takers: Vec<Taker> = Vec::new();
    let mut listener_rests_until: Option<Instant> = None;
    loop {
        let listening = listener_rests_until.map_or(true, |t| Instant::now() >= t);
        // Wake for the listener's rest and for the earliest deadline of a request begun.
        let wake = takers.iter().filter_map(|t| t.since.map(|s| s + REQUEST_DEADLINE)).chain(listener_rests_until.filter(|_| !listening)).min();
        let ready: Vec<(bool, bool)> = {
            let mut fds = Vec::with_capacity(takers.len() + 1);
            if listening {
                fds.push(PollFd::new(&listener, PollFlags::IN));
            }
            fds.extend(takers.iter().map(|t| PollFd::new(&t.conn, PollFlags::IN)));
            let left = wake.map(|w| w.saturating_duration_since(Instant::now()));
            let timeout = left.map(|d| rustix::event::Timespec { tv_sec: d.as_secs() as i64, tv_nsec: d.subsec_nanos() as i64 });
            match rustix::event::poll(&mut fds, timeout.as_ref()) {
                Ok(_) => {}
                Err(e) if e == rustix::io::Errno::INTR => continue,
                Err(_) => return,
            }
            fds.iter().map(|f| (f.revents().contains(PollFlags::IN), f.revents().intersects(PollFlags::HUP | PollFlags::ERR))).collect()
        };
        let (listener_ready, taker_ready) = if listening { (ready[0].0, &ready[1..]) } else { (false, &ready[..]) };
        // Answer, and drop takers that hung up, misbehaved or ran out of time: off the list
        // first, closed after (see `SERVER_FDS`).
        let mut keep = Vec::with_capacity(takers.len());
        let mut gone_takers = Vec::new();
        let now = Instant::now();
        for (mut t, &(readable, gone)) in takers.drain(..).zip(taker_ready) {
            let ok = if readable {
                match t.read_some() {
                    Ok(true) => {
                        let key = t.key;
                        (t.got, t.since, t.used) = (0, None, now);
                        answer(&t.conn, &key).is_ok()
                    }
                    Ok(false) => !t.late(now),
                    Err(_) => false,
                }
            } else {
                !gone && !t.late(now)
            };
            if ok {
                keep.push(t);
            } else {
                gone_takers.push(t);
            }
        }
        takers = keep;
        if !gone_takers.is_empty() {
            set_fds(&listener, &takers);
            drop(gone_takers);
        }
        if !listening {
            if listener_rests_until.is_some_and(|t| Instant::now() >= t) {
                listener_rests_until = None; // rested: listen again
            }
        } else if listener_ready {
            loop {
                match listener.accept() {
                    Ok((t, _)) => {
                        if same_user(&t) && t.set_nonblocking(true).is_ok() && t.set_write_timeout(Some(REQUEST_DEADLINE)).is_ok() {
                            let evicted = (takers.len() >= MAX_TAKERS).then(|| {
                                let i = idle_longest(&takers);
                                takers.swap_remove(i)
                            });
                            takers.push(Taker { conn: t, used: Instant::now(), key: [0; KEY_BYTES], got: 0, since: None });
                            set_fds(&listener, &takers);
                            drop(evicted); // closed once off the list (see `SERVER_FDS`)
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(_) => {
                        // Out of descriptors, most likely: the connection stays queued and
                        // the listener readable, so rest it rather than spin.
                        listener_rests_until = Some(Instant::now() + ACCEPT_PAUSE);
                        break;
                    }
                }
            }
        }
    }
}

/// Answer the request `key` of `conn`: its handover, or that there is none. The answer's
/// writes block (each up to `REQUEST_DEADLINE`, the write timeout), then reads go back to
/// not waiting.
fn answer(conn: &UnixStream, key: &[u8; KEY_BYTES]) -> std::io::Result<()> {
    let mut found = WAITING.lock().ok().and_then(|mut w| w.as_mut().and_then(|w| w.remove(key)));
    if found.is_none() {
        // A standing export's descriptors, asked for by an importer that may not copy them
        // itself (`super::take_export`): copies made under the export record's lock, so
        // they are the export's while its token is live.
        if let Some((slot, token)) = super::export_of_key(key) {
            found = ExportRecord::handed(slot, token).map(|fds| super::Handover { fds, sends: 0 });
        }
    }
    conn.set_nonblocking(false)?;
    // The sender's copies close after, whether or not they arrived: a handover goes once.
    match &found {
        None => wire::write_header(conn, wire::UNKNOWN, 0, 0),
        Some(h) => wire::write_header(conn, wire::FOUND, h.fds.len() as u32, h.sends).and_then(|()| wire::send_fds(conn, &h.fds)),
    }?;
    conn.set_nonblocking(true)
}
