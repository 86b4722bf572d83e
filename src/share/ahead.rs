//! Opening a message's sends ahead, on a thread of the library, while the interpreter
//! unpickles the message (`gpupool.share`'s receiving route).
//!
//! Why: an import is driver work (an arena block's: a reservation, an import and a map per
//! allocation, an access grant; a segment's: `cuIpcOpenMemHandle`) of tens of
//! microseconds per allocation, and the unpickling around it is Python work of about as
//! much per tensor. Made one after the other on the unpickling thread they add up; the
//! driver runs the imports beside the interpreter's work without slowing it
//! (`docs/ipc.md` points to the measurement), so the sender lists the message's sends
//! ahead of its bytes and the receiver opens them here while it unpickles, each rebuild
//! taking its send's import (`Batch::take`) instead of making it.
//!
//! Each import is exactly the one `Received::open` would make for the rebuild, in the
//! message's order, so what maps through which span is unchanged. The descriptors are this
//! module's own copies (`dup`), closed when the batch ends, so the caller may close its
//! own at any time. `Batch::end` stops and waits for the thread and closes what no rebuild
//! took. After a message that unpickled, a send no rebuild took keeps its hold (whoever
//! kept its `Sent` may still open it, as without this module); after one that failed,
//! nobody will, so every send not taken is let go.

use super::descriptor::AnyDescriptor;
use super::received::{contained, Received};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

/// What opening ahead has cost this process, in nanoseconds (`report_json`): batches
/// started; from a batch's start to its thread's first line; the thread's time opening
/// sends; the callers' time waiting in `Batch::take`.
static BATCHES: AtomicU64 = AtomicU64::new(0);
static THREAD_START_NS: AtomicU64 = AtomicU64::new(0);
static OPENING_NS: AtomicU64 = AtomicU64::new(0);
static TAKE_WAIT_NS: AtomicU64 = AtomicU64::new(0);

/// One send to open: its descriptor's bytes, its device, the holds file's descriptor (-1:
/// no hold) and its slot, and the block's descriptors (the caller's numbers: `Batch::start`
/// opens its own copies).
pub struct Send {
    pub desc: Vec<u8>,
    pub device: i32,
    pub holds_fd: i32,
    pub slot: u32,
    pub fds: Vec<i32>,
}

/// Where a send stands: not reached yet, opened or refused, or handed to a rebuild.
enum Opened {
    Waiting,
    Ready(Result<Received>),
    Taken,
}

struct State {
    opened: Vec<Opened>,
    /// Set by `end`: the thread opens nothing more.
    stop: bool,
    /// The thread has left its loop.
    finished: bool,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A message's sends being opened ahead.
pub struct Batch {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Each send's hold (the copy of its holds file's descriptor, its slot), for letting go
    /// of the sends of a message that failed.
    holds: Vec<(i32, u32)>,
    /// The copies of the caller's descriptors, closed when the batch ends (after the thread).
    _copies: HashMap<i32, OwnedFd>,
}

/// A close-on-exec copy of each of `numbers` (each number once), by the caller's number.
fn copies(numbers: impl Iterator<Item = i32>) -> Result<HashMap<i32, OwnedFd>> {
    let mut out = HashMap::new();
    for n in numbers {
        if out.contains_key(&n) {
            continue;
        }
        // SAFETY: F_DUPFD_CLOEXEC on a number the caller says is open; a failure is an error.
        let c = unsafe { libc::fcntl(n, libc::F_DUPFD_CLOEXEC, 0) };
        if c < 0 {
            return Err(Error::InvalidArgument(format!(
                "opening sends ahead: descriptor {n} cannot be copied: {}",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: `c` was just made and is owned here alone.
        out.insert(n, unsafe { OwnedFd::from_raw_fd(c) });
    }
    Ok(out)
}

fn run(shared: &Shared, sends: Vec<Send>, started: Instant) {
    THREAD_START_NS.fetch_add(started.elapsed().as_nanos() as u64, Relaxed);
    /// Marks the thread finished however it leaves (a rebuild waiting for a send must not
    /// wait for ever).
    struct Finished<'a>(&'a Shared);
    impl Drop for Finished<'_> {
        fn drop(&mut self) {
            self.0.lock().finished = true;
            self.0.changed.notify_all();
        }
    }
    let _finished = Finished(shared);
    for (i, s) in sends.into_iter().enumerate() {
        if shared.lock().stop {
            break;
        }
        let t = Instant::now();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let d = AnyDescriptor::decode(&s.desc)?;
            Received::open(&d, s.device, &s.fds, s.holds_fd, s.slot)
        }))
        .unwrap_or_else(|_| Err(Error::Internal("opening a send ahead panicked".into())));
        OPENING_NS.fetch_add(t.elapsed().as_nanos() as u64, Relaxed);
        shared.lock().opened[i] = Opened::Ready(r);
        shared.changed.notify_all();
    }
}

impl Batch {
    /// Start opening `sends` on a thread of the library. Every descriptor is copied before
    /// this returns: the caller's stay the caller's.
    pub fn start(mut sends: Vec<Send>) -> Result<Batch> {
        let copied = copies(sends.iter().flat_map(|s| s.fds.iter().copied().chain([s.holds_fd])).filter(|&f| f >= 0))?;
        let mine = |f: i32| if f >= 0 { copied[&f].as_raw_fd() } else { f };
        for s in &mut sends {
            s.holds_fd = mine(s.holds_fd);
            for f in &mut s.fds {
                *f = mine(*f);
            }
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State { opened: sends.iter().map(|_| Opened::Waiting).collect(), stop: false, finished: false }),
            changed: Condvar::new(),
        });
        let holds = sends.iter().map(|s| (s.holds_fd, s.slot)).collect();
        let theirs = shared.clone();
        let started = Instant::now();
        let thread = std::thread::Builder::new()
            .name("gpupool-ahead".into())
            .spawn(move || run(&theirs, sends, started))
            .map_err(|e| Error::Internal(format!("opening sends ahead: cannot start a thread: {e}")))?;
        BATCHES.fetch_add(1, Relaxed);
        Ok(Batch { shared, thread: Some(thread), holds, _copies: copied })
    }

    /// Send `i`'s import (waiting for it if the thread has not reached it), now the
    /// caller's; `None` where the send was not opened ahead (the batch ended before it, or
    /// it was taken already): open it as usual then. An import that failed returns its error.
    pub fn take(&self, i: usize) -> Result<Option<Received>> {
        let mut st = self.shared.lock();
        if i >= st.opened.len() {
            return Err(Error::InvalidArgument(format!("opening sends ahead: no send {i} in a batch of {}", st.opened.len())));
        }
        let t = Instant::now();
        while matches!(st.opened[i], Opened::Waiting) && !st.finished {
            st = self.shared.changed.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        TAKE_WAIT_NS.fetch_add(t.elapsed().as_nanos() as u64, Relaxed);
        match std::mem::replace(&mut st.opened[i], Opened::Taken) {
            Opened::Ready(r) => r.map(Some),
            Opened::Waiting | Opened::Taken => Ok(None),
        }
    }

    /// End the batch: the thread opens nothing more and is waited for, and what no rebuild
    /// took is closed. `failed` false: the message unpickled, and a send no rebuild took
    /// keeps its hold (whoever kept it may still open it). Otherwise the message failed and
    /// nobody will open its sends: every send not taken is let go (its hold released),
    /// whether or not the thread had opened it.
    pub fn end(mut self, failed: bool) {
        self.shared.lock().stop = true;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let left: Vec<(usize, Opened)> =
            self.shared.lock().opened.iter_mut().map(|o| std::mem::replace(o, Opened::Taken)).enumerate().collect();
        for (i, o) in left {
            match o {
                Opened::Ready(Ok(mut r)) => {
                    if !failed {
                        r.keep_hold();
                    }
                    if let Err(f) = r.close() {
                        crate::error::warn(&format!(
                            "gpupool: warning: closing an import opened ahead and not taken failed: {}; {} hold(s) of its \
                             sender stay held",
                            f.error, f.holds_kept
                        ));
                    }
                }
                Opened::Waiting | Opened::Ready(Err(_)) if failed => {
                    let (fd, slot) = self.holds[i];
                    if fd >= 0 {
                        let _ = contained("releasing a hold", || super::holds::map_theirs(fd).and_then(|id| super::holds::release(id, slot)));
                    }
                }
                _ => {}
            }
        }
    }
}

/// What opening sends ahead has cost this process so far, as JSON (its fields are the C
/// contract: `gpupool_share_ahead_json`).
pub fn report_json() -> String {
    use crate::upstream::cuda::address_space::import::{IMPORTS_MADE, IMPORT_NS, IMPORT_PHASES};
    let s = |ns: &AtomicU64| ns.load(Relaxed) as f64 * 1e-9;
    let phases: Vec<String> = IMPORT_PHASES.iter().zip(&IMPORT_NS).map(|(k, v)| format!("\"{k}_s\":{:.6}", s(v))).collect();
    format!(
        "{{\"batches\":{},\"thread_start_s\":{:.6},\"opening_s\":{:.6},\"take_wait_s\":{:.6},\"imports\":{{\"count\":{},{}}}}}",
        BATCHES.load(Relaxed),
        s(&THREAD_START_NS),
        s(&OPENING_NS),
        s(&TAKE_WAIT_NS),
        IMPORTS_MADE.load(Relaxed),
        phases.join(",")
    )
}
