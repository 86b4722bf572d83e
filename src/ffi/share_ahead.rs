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
//! taking its send's import (`gpupool_share_take_ahead`) instead of making it.
//!
//! Each import is exactly the one `gpupool_ipc_open_dlpack` would make, in the message's
//! order, so what maps through which span is unchanged. The descriptors are this
//! module's own copies (`dup`), closed when the batch ends, so the caller may close its
//! own at any time. `gpupool_share_end_ahead` stops and waits for the thread and closes
//! what no rebuild took. After a message that unpickled, a send no rebuild took keeps its
//! hold (whoever kept its `Sent` may still open it, as without this module); after one
//! that failed, nobody will, so every send not taken is let go.

use super::boundary::call;
use super::ipc::read_descriptor;
use super::share::{close_keeping_hold, delete_imported, open_imported};
use crate::error::Error;
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

/// What opening ahead has cost this process, in nanoseconds (`gpupool_share_ahead_json`):
/// batches started; from a batch's start to its thread's first line; the thread's time
/// opening sends; the callers' time waiting in `gpupool_share_take_ahead`.
static BATCHES: AtomicU64 = AtomicU64::new(0);
static THREAD_START_NS: AtomicU64 = AtomicU64::new(0);
static OPENING_NS: AtomicU64 = AtomicU64::new(0);
static TAKE_WAIT_NS: AtomicU64 = AtomicU64::new(0);

/// One send to open: its descriptor's bytes, its device, its descriptors (this module's
/// copies) and its hold.
struct Send {
    desc: Vec<u8>,
    device: c_int,
    fds: Vec<c_int>,
    holds_fd: c_int,
    slot: u32,
}

/// Where a send stands: not reached yet, opened (a `DlManagedTensor*`) or refused, or
/// handed to a rebuild.
enum Opened {
    Waiting,
    Ready(crate::error::Result<usize>),
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

/// What `gpupool_share_open_ahead` hands out.
struct Batch {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Each send's hold (the copy of its holds file's descriptor, its slot), for letting go
    /// of the sends of a message that failed.
    holds: Vec<(c_int, u32)>,
    /// The copies of the caller's descriptors, closed when the batch ends (after the thread).
    _copies: HashMap<c_int, OwnedFd>,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A close-on-exec copy of each of `numbers` (each number once), by the caller's number.
fn copies(numbers: impl Iterator<Item = c_int>) -> crate::error::Result<HashMap<c_int, OwnedFd>> {
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
            // SAFETY: the bytes are this module's own.
            let d = unsafe { read_descriptor(s.desc.as_ptr().cast(), s.desc.len()) }?;
            open_imported(&d, s.device, &s.fds, s.holds_fd, s.slot).map(|t| t as usize)
        }))
        .unwrap_or_else(|_| Err(Error::Internal("opening a send ahead panicked".into())));
        OPENING_NS.fetch_add(t.elapsed().as_nanos() as u64, Relaxed);
        shared.lock().opened[i] = Opened::Ready(r);
        shared.changed.notify_all();
    }
}

/// Start opening `n` sends on a thread of the library. Send `i` is the descriptor of
/// `desc_lens[i]` bytes that follows the previous ones in `descs`, on device `devices[i]`,
/// with hold `slots[i]`; its `n_fds[i]` entries of `fds` (following the previous sends')
/// are the holds file's descriptor (-1: no hold) and then the block's descriptors, as
/// `gpupool_ipc_open_dlpack` takes them (one per granule, or each exporter number once in
/// the order of its first appearance). Every descriptor is copied before this returns:
/// the caller's stay the caller's. `*out_batch` receives the batch: take each send's
/// import with `gpupool_share_take_ahead`, and end it with `gpupool_share_end_ahead`
/// (exactly once).
///
/// # Safety
/// `desc_lens`, `devices`, `slots` and `n_fds` hold `n` readable entries, `descs` their
/// sum of `desc_lens` bytes and `fds` that of `n_fds` ints; `out_batch` writable.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn gpupool_share_open_ahead(
    n: usize,
    descs: *const c_void,
    desc_lens: *const usize,
    devices: *const c_int,
    slots: *const u32,
    fds: *const c_int,
    n_fds: *const usize,
    out_batch: *mut *mut c_void,
) -> crate::error::Status {
    call(|| {
        crate::fork::refuse_in_child()?;
        if out_batch.is_null() {
            return Err(Error::NullArgument("out_batch"));
        }
        *out_batch = std::ptr::null_mut();
        if n > 0 && [desc_lens.is_null(), devices.is_null(), slots.is_null(), n_fds.is_null()].contains(&true) {
            return Err(Error::NullArgument("desc_lens, devices, slots or n_fds"));
        }
        let (lens, counts) = if n == 0 { (&[][..], &[][..]) } else { (std::slice::from_raw_parts(desc_lens, n), std::slice::from_raw_parts(n_fds, n)) };
        let mut total_bytes = 0usize;
        for &l in lens {
            if l > crate::upstream::shared::MAX_DESCRIPTOR_BYTES {
                return Err(Error::InvalidArgument(format!("IPC descriptor: {l} bytes is longer than any descriptor")));
            }
            // Each at most MAX_DESCRIPTOR_BYTES; a count that still overflows is refused.
            total_bytes = total_bytes.checked_add(l).ok_or_else(|| Error::InvalidArgument("opening sends ahead: descriptor lengths out of range".into()))?;
        }
        let total_fds = counts.iter().try_fold(0usize, |a, &c| a.checked_add(c)).ok_or_else(|| Error::InvalidArgument("opening sends ahead: descriptor counts out of range".into()))?;
        if counts.contains(&0) {
            return Err(Error::InvalidArgument("opening sends ahead: each send needs at least its holds file's entry".into()));
        }
        if total_bytes > 0 && descs.is_null() {
            return Err(Error::NullArgument("descs"));
        }
        if total_fds > 0 && fds.is_null() {
            return Err(Error::NullArgument("fds"));
        }
        let bytes = if total_bytes == 0 { &[][..] } else { std::slice::from_raw_parts(descs.cast::<u8>(), total_bytes) };
        let all_fds = if total_fds == 0 { &[][..] } else { std::slice::from_raw_parts(fds, total_fds) };
        let copied = copies(all_fds.iter().copied().filter(|&f| f >= 0))?;
        let (mut at_byte, mut at_fd) = (0, 0);
        let mut sends = Vec::with_capacity(n);
        for i in 0..n {
            let mine = &all_fds[at_fd..at_fd + counts[i]];
            let mapped = |f: c_int| if f >= 0 { copied[&f].as_raw_fd() } else { f };
            sends.push(Send {
                desc: bytes[at_byte..at_byte + lens[i]].to_vec(),
                device: *devices.add(i),
                fds: mine[1..].iter().map(|&f| mapped(f)).collect(),
                holds_fd: mapped(mine[0]),
                slot: *slots.add(i),
            });
            at_byte += lens[i];
            at_fd += counts[i];
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State { opened: (0..n).map(|_| Opened::Waiting).collect(), stop: false, finished: false }),
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
        *out_batch = Box::into_raw(Box::new(Batch { shared, thread: Some(thread), holds, _copies: copied })).cast();
        Ok(())
    })
}

/// Send `i`'s import from `batch` (waiting for it if the thread has not reached it):
/// `*out_tensor` receives the `DLManagedTensor*` `gpupool_ipc_open_dlpack` would have made
/// (now the caller's), or NULL where the send was not opened ahead (the batch ended before
/// it, or it was taken already): open it as usual then. An import that failed returns its
/// error, as `gpupool_ipc_open_dlpack` would have.
///
/// # Safety
/// `batch` from `gpupool_share_open_ahead`, not yet ended; `out_tensor` writable.
#[no_mangle]
pub unsafe extern "C" fn gpupool_share_take_ahead(batch: *mut c_void, i: usize, out_tensor: *mut *mut c_void) -> crate::error::Status {
    call(|| {
        crate::fork::refuse_in_child()?;
        if batch.is_null() || out_tensor.is_null() {
            return Err(Error::NullArgument(if batch.is_null() { "batch" } else { "out_tensor" }));
        }
        *out_tensor = std::ptr::null_mut();
        let shared = &(*batch.cast::<Batch>()).shared;
        let mut st = shared.lock();
        if i >= st.opened.len() {
            return Err(Error::InvalidArgument(format!("opening sends ahead: no send {i} in a batch of {}", st.opened.len())));
        }
        let t = Instant::now();
        while matches!(st.opened[i], Opened::Waiting) && !st.finished {
            st = shared.changed.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        TAKE_WAIT_NS.fetch_add(t.elapsed().as_nanos() as u64, Relaxed);
        match std::mem::replace(&mut st.opened[i], Opened::Taken) {
            Opened::Ready(Ok(t)) => *out_tensor = t as *mut c_void,
            Opened::Ready(Err(e)) => return Err(e),
            Opened::Waiting | Opened::Taken => {}
        }
        Ok(())
    })
}

/// End `batch`: the thread opens nothing more and is waited for, what no rebuild took is
/// closed, and the batch is freed. `failed` 0: the message unpickled, and a send no
/// rebuild took keeps its hold (whoever kept it may still open it). Otherwise the message
/// failed and nobody will open its sends: every send not taken is let go (its hold
/// released), whether or not the thread had opened it.
///
/// # Safety
/// `batch` from `gpupool_share_open_ahead`, not ended before (NULL: nothing happens).
#[no_mangle]
pub unsafe extern "C" fn gpupool_share_end_ahead(batch: *mut c_void, failed: c_int) -> crate::error::Status {
    call(|| {
        crate::fork::refuse_in_child()?;
        if batch.is_null() {
            return Ok(());
        }
        let mut b = Box::from_raw(batch.cast::<Batch>());
        b.shared.lock().stop = true;
        if let Some(t) = b.thread.take() {
            let _ = t.join();
        }
        let left: Vec<(usize, Opened)> =
            b.shared.lock().opened.iter_mut().map(|o| std::mem::replace(o, Opened::Taken)).enumerate().collect();
        for (i, o) in left {
            match o {
                Opened::Ready(Ok(t)) if failed != 0 => delete_imported(t as *mut _),
                Opened::Ready(Ok(t)) => close_keeping_hold(t as *mut _),
                Opened::Waiting | Opened::Ready(Err(_)) if failed != 0 => {
                    let (fd, slot) = b.holds[i];
                    if fd >= 0 {
                        let _ = crate::share::holds::map_theirs(fd).and_then(|id| crate::share::holds::release(id, slot));
                    }
                }
                _ => {}
            }
        }
        Ok(())
    })
}

/// What opening sends ahead has cost this process so far, as JSON (same buffer convention
/// as `gpupool_memory_status`): `batches` started; seconds from a batch's start to its
/// thread's first line (`thread_start_s`), spent by the threads opening sends
/// (`opening_s`) and by rebuilds waiting for them (`take_wait_s`); and `imports`: how many
/// arena imports this process made or tried on a GPU, ahead or not (`count`), with the
/// seconds spent in each kind of driver call they make (`reserve_s`, `import_s` with the
/// descriptor's checks, `map_s`, `release_s`, `grant_s`).
///
/// # Safety
/// `buf` must be NULL or point to `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn gpupool_share_ahead_json(buf: *mut std::ffi::c_char, len: usize) -> usize {
    super::boundary::call_value(0, || {
        use crate::upstream::cuda::address_space::import::{IMPORTS_MADE, IMPORT_NS, IMPORT_PHASES};
        let s = |ns: &AtomicU64| ns.load(Relaxed) as f64 * 1e-9;
        let phases: Vec<String> = IMPORT_PHASES.iter().zip(&IMPORT_NS).map(|(k, v)| format!("\"{k}_s\":{:.6}", s(v))).collect();
        let json = format!(
            "{{\"batches\":{},\"thread_start_s\":{:.6},\"opening_s\":{:.6},\"take_wait_s\":{:.6},\"imports\":{{\"count\":{},{}}}}}",
            BATCHES.load(Relaxed),
            s(&THREAD_START_NS),
            s(&OPENING_NS),
            s(&TAKE_WAIT_NS),
            IMPORTS_MADE.load(Relaxed),
            phases.join(",")
        );
        super::boundary::write_str(&json, buf, len)
    })
}
