//! The sender's side of the handover: one thread of the library that accepts takers on an
//! abstract Unix socket and answers their requests (a key in, the handover's descriptors
//! out), with no interpreter lock and no thread per taker.
//!
//! Why one thread for every taker: a thread started per taker cost milliseconds in a
//! process the size of a CUDA program's, paid by the taker's first handover; a request is a
//! lookup and a few `sendmsg`. What keeps one misbehaving peer of the same user (others are
//! refused) from holding it: a request must arrive whole within `REQUEST_DEADLINE`, and
//! an answer's writes time out likewise; at most `MAX_TAKERS` connections are kept (a new
//! taker beyond them closes the one idle longest, whose taker connects anew when it next
//! asks: no taker is turned away); a failing `accept` (the open-file limit) pauses the
//! listener instead of spinning. Signals
//! are blocked in the thread (a handler without `SA_RESTART`, as CPython installs them,
//! would interrupt its calls). If the thread ends anyway, `name()` says so and no new
//! handover is offered through it (the Python route falls back to multiprocessing's
//! resource sharer).

use super::{wire, KEY_BYTES, WAITING};
use crate::error::{Error, Result};
use crate::upstream::shared::FileId;
use rustix::event::{PollFd, PollFlags};
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

/// This process's socket name (abstract), once its thread listens; or why it could not.
static SERVER: OnceLock<std::result::Result<Vec<u8>, String>> = OnceLock::new();
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

/// The listening socket's name, starting its thread the first time.
pub(super) fn name() -> Result<&'static [u8]> {
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
        let tag = super::random::<8>().map_err(|e| e.to_string())?;
        let name = format!("gpupool-handover-{}-{}", std::process::id(), super::hex(&tag)).into_bytes();
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
        Ok(name)
    });
    match started {
        Ok(name) if SERVING.load(Ordering::SeqCst) => Ok(name),
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

fn set_fds(listener: &UnixListener, takers: &[UnixStream]) {
    let mut fds = SERVER_FDS.lock().unwrap_or_else(|p| p.into_inner());
    fds.clear();
    let all = std::iter::once(listener.as_raw_fd()).chain(takers.iter().map(|t| t.as_raw_fd()));
    fds.extend(all.filter_map(|fd| Some((fd, FileId::of(fd).ok()?))));
}

/// The kept connection idle longest (`takers` and `used` side by side): what a new taker
/// beyond `MAX_TAKERS` replaces. The thread serves one request at a time, so no kept
/// connection is midway through an answer here; a request its taker wrote but this thread
/// has not read goes unanswered, and the taker sends it again on a new connection.
fn idle_longest(used: &[Instant]) -> usize {
    used.iter().enumerate().min_by_key(|(_, t)| **t).map_or(0, |(i, _)| i)
}

fn serve(listener: UnixListener) {
    let mut takers: Vec<UnixStream> = Vec::new();
    // When each kept connection last brought a request (or was accepted).
    let mut used: Vec<Instant> = Vec::new();
    let mut listener_rests_until: Option<Instant> = None;
    loop {
        let listening = listener_rests_until.map_or(true, |t| Instant::now() >= t);
        let ready: Vec<(bool, bool)> = {
            let mut fds = Vec::with_capacity(takers.len() + 1);
            if listening {
                fds.push(PollFd::new(&listener, PollFlags::IN));
            }
            fds.extend(takers.iter().map(|t| PollFd::new(t, PollFlags::IN)));
            let rest = rustix::event::Timespec { tv_sec: 0, tv_nsec: ACCEPT_PAUSE.as_nanos() as i64 };
            match rustix::event::poll(&mut fds, if listening { None } else { Some(&rest) }) {
                Ok(_) => {}
                Err(e) if e == rustix::io::Errno::INTR => continue,
                Err(_) => return,
            }
            fds.iter().map(|f| (f.revents().contains(PollFlags::IN), f.revents().intersects(PollFlags::HUP | PollFlags::ERR))).collect()
        };
        let (listener_ready, taker_ready) = if listening { (ready[0].0, &ready[1..]) } else { (false, &ready[..]) };
        // Answer, and drop takers that hung up or misbehaved: off the list first, closed
        // after (see `SERVER_FDS`).
        let mut keep = Vec::with_capacity(takers.len());
        let mut keep_used = Vec::with_capacity(takers.len());
        let mut gone_takers = Vec::new();
        let now = Instant::now();
        for ((mut t, last), &(readable, gone)) in takers.drain(..).zip(used.drain(..)).zip(taker_ready) {
            let ok = if readable { answer(&mut t).is_ok() } else { !gone };
            if ok {
                keep.push(t);
                keep_used.push(if readable { now } else { last });
            } else {
                gone_takers.push(t);
            }
        }
        takers = keep;
        used = keep_used;
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
                        if same_user(&t) && t.set_nonblocking(false).is_ok() && t.set_write_timeout(Some(REQUEST_DEADLINE)).is_ok() {
                            let evicted = (takers.len() >= MAX_TAKERS).then(|| {
                                let i = idle_longest(&used);
                                used.swap_remove(i);
                                takers.swap_remove(i)
                            });
                            takers.push(t);
                            used.push(Instant::now());
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

/// Answer one request of `conn`: read a key (whole within `REQUEST_DEADLINE`), send its
/// handover, or say there is none.
fn answer(conn: &mut UnixStream) -> std::io::Result<()> {
    let mut key = [0u8; KEY_BYTES];
    wire::read_by(conn, &mut key, Instant::now() + REQUEST_DEADLINE)?;
    let found = WAITING.lock().ok().and_then(|mut w| w.as_mut().and_then(|w| w.remove(&key)));
    // The sender's copies close after, whether or not they arrived: a handover goes once.
    match &found {
        None => wire::write_header(conn, wire::UNKNOWN, 0, 0),
        Some(h) => wire::write_header(conn, wire::FOUND, h.fds.len() as u32, h.sends).and_then(|()| wire::send_fds(conn, &h.fds)),
    }
}
