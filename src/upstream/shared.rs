//! Sharing arena memory with another process: the descriptor an exporter hands out and an
//! importer maps, and how the importer gets the exporter's file descriptors.
//!
//! Why this exists: `cudaIpcGetMemHandle` refuses memory from the virtual memory API, so
//! the arena's memory needs its own route. Each granule is a physical allocation of its
//! own (`address_space.rs` says why), created with a POSIX file descriptor as its
//! shareable handle type; exporting a block exports the granules under it, one descriptor
//! each, and the importer maps them side by side in a range of its own.
//!
//! The descriptor is plain bytes (send it through any pipe, socket or pickle): the
//! exporter's pid, the granule size, where the block starts in its first granule, its
//! size, and per granule the exporter's file descriptor number and the offset of the
//! granule's memory behind it (0 for CUDA, a file offset for the host upstream's
//! stand-in). The importer either passes descriptors it received itself (`SCM_RIGHTS`,
//! inheritance) or lets `FdSource::fetch_from` copy them out of the exporter with
//! `pidfd_getfd` (Linux 5.6+, and the right to ptrace the exporter: same user, Yama's
//! `ptrace_scope` allowing it), one granule at a time so a block of thousands of granules
//! never holds more than one fetched descriptor open. The kernel passes at most 253
//! descriptors in one `SCM_RIGHTS` message, so a sender of a larger block sends several.
//! The exporter keeps each granule's descriptor open (close-on-exec) while the granule is
//! mapped, so a descriptor stays fetchable as long as the block is live.
//!
//! Trust. A descriptor names file descriptor numbers in another process, and numbers are
//! reused: a stale descriptor (its block freed, the number since given to another file), a
//! reused pid, or a forged one (a client steering a privileged importer) would map memory
//! nobody exported. So the descriptor binds what it names: the exporter's start time (a
//! reused pid is another process, started later) and each granule's file identity (device
//! and inode, as `fstat` gives them at export). The importer checks both on every
//! descriptor it maps, fetched or passed in, and refuses, saying why, where one differs.
//! File identity alone does not tell the driver's exported descriptors apart (each is an
//! open of `/dev/nvidiactl`), so the exporter also keeps a record of its live exports
//! (`ExportRecord`): a `memfd` of its own with a random token per export, beside the digest
//! of the export's granule list, cleared before any granule of that export is released and
//! its descriptor closed. A descriptor names the record's descriptor number, its slot and
//! its token; an importer that fetches descriptors by pid fetches the record too, checks
//! that it is this exporter's (magic, pid, start time), that the slot still holds the token
//! and the digest of the descriptor's granules (entries changed after export are refused),
//! and checks again after each granule's descriptor is fetched: a descriptor fetched while
//! its export's token was still there is that export's (the record is cleared first). A stale descriptor (its
//! block freed, its memory released, the numbers reused) is refused. Descriptors passed in
//! by the caller (`SCM_RIGHTS`) come from whoever holds the memory and are checked by file
//! identity alone. An export also ends when its block is freed (the pool ends it before
//! the block's memory can serve another allocation).

use super::export_record::{ExportRecord, RecordRef};
use crate::error::{Error, Result};

pub mod identity;
mod open_mark;
pub use open_mark::OpenMark;
pub use identity::{granules_digest, own_start_time, start_time_of, FileId, Fd, SharedGranule};

/// A descriptor flag: the block's memory may be paused (it is a tag's), so an importer
/// unmaps it when closed instead of keeping it for the exporter's next message: a receiver
/// that let go holds none of the memory a pause gives back.
pub const FLAG_UNKEPT: u32 = 1;

/// Which memory a descriptor describes (an importer maps only its own kind).
pub const KIND_CUDA: u32 = 1;
pub const KIND_HOST: u32 = 2;

/// What the exporter says about one block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Descriptor {
    pub kind: u32,
    pub pid: u32,
    /// The exporter's start time (`start_time_of`): a process that got its pid later is not it.
    pub start_time: u64,
    /// Where the exporter records this export (`ExportRecord`): its descriptor number there,
    /// the slot and the token.
    pub record: RecordRef,
    pub device: i32,
    pub granule: u64,
    /// The block's start, from the start of its first granule.
    pub offset: u64,
    pub size: u64,
    /// Where the block's first granule is in the exporter: with the pid and start time it
    /// names that granule, so an importer can map a granule once for every block of it
    /// that it holds (`gpupool_ipc_open_dlpack`).
    pub origin: u64,
    /// The random part of the exporter's handover socket name (`share::handover`; 0: it
    /// has none): where an importer that may not copy the exporter's descriptors itself
    /// (`Error::FetchRefused`) asks the exporter for them.
    pub handover: u64,
    /// `FLAG_*` bits.
    pub flags: u32,
    pub granules: Vec<SharedGranule>,
}

const MAGIC: &[u8; 8] = b"GPPIPC06";
/// Bytes before the granules: magic, kind, pid, device, flags, granule, offset, size,
/// count, start time, record descriptor + slot, token, origin, handover.
pub const HEADER_BYTES: usize = 8 + 4 * 4 + 8 * 5 + 4 * 2 + 8 + 8 + 8;
/// Per granule: descriptor number, offset, file device, file inode.
pub const GRANULE_BYTES: usize = 32;
/// A block of more granules than this is refused (16 TiB of 2 MiB granules), so a
/// corrupt count cannot make an importer allocate without bound.
pub const MAX_GRANULES: u64 = 1 << 23;
/// The longest descriptor there can be; a longer length is refused before its bytes are read.
pub const MAX_DESCRIPTOR_BYTES: usize = HEADER_BYTES + GRANULE_BYTES * MAX_GRANULES as usize;

impl Descriptor {
    /// An importer's descriptors, one per granule, from `given`: one per granule already,
    /// or one per distinct exporter descriptor in the order the granules first name them
    /// (a chunk's granules share one: sending that list costs no per-granule work, however
    /// many granules a block lists). `None`: `given` is neither.
    pub fn per_granule<'a>(&self, given: &'a [i32]) -> Option<std::borrow::Cow<'a, [i32]>> {
        if given.len() == self.granules.len() {
            return Some(std::borrow::Cow::Borrowed(given));
        }
        let mut at: rustc_hash::FxHashMap<i32, usize> = Default::default();
        let mut out = Vec::with_capacity(self.granules.len());
        for g in &self.granules {
            let next = at.len();
            let i = *at.entry(g.fd).or_insert(next);
            out.push(*given.get(i)?);
        }
        (at.len() == given.len()).then_some(std::borrow::Cow::Owned(out))
    }

    pub fn encoded_len(&self) -> usize {
        HEADER_BYTES + GRANULE_BYTES * self.granules.len()
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(self.encoded_len());
        b.extend_from_slice(MAGIC);
        for v in [self.kind, self.pid, self.device as u32, self.flags] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        for v in [self.granule, self.offset, self.size, self.granules.len() as u64, self.start_time] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&(self.record.fd as u32).to_le_bytes());
        b.extend_from_slice(&self.record.slot.to_le_bytes());
        b.extend_from_slice(&self.record.token.to_le_bytes());
        b.extend_from_slice(&self.origin.to_le_bytes());
        b.extend_from_slice(&self.handover.to_le_bytes());
        for g in &self.granules {
            for v in [g.fd as u32 as u64, g.offset, g.file.dev, g.file.ino] {
                b.extend_from_slice(&v.to_le_bytes());
            }
        }
        b
    }

    /// Parse `b`, checking that it is whole and consistent (the bytes came from another
    /// process, maybe through a user's code).
    pub fn decode(b: &[u8]) -> Result<Descriptor> {
        let bad = |why: &str| Error::InvalidArgument(format!("IPC descriptor: {why}"));
        if b.len() < HEADER_BYTES || &b[..8] != MAGIC {
            return Err(bad("not a gpupool IPC descriptor (wrong length or magic)"));
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let (kind, pid, device, flags) = (u32_at(8), u32_at(12), u32_at(16) as i32, u32_at(20));
        let (granule, offset, size, count, start_time) = (u64_at(24), u64_at(32), u64_at(40), u64_at(48), u64_at(56));
        let record = RecordRef { fd: u32_at(64) as i32, slot: u32_at(68), token: u64_at(72) };
        let origin = u64_at(80);
        let handover = u64_at(88);
        if kind != KIND_CUDA && kind != KIND_HOST {
            return Err(bad(&format!("unknown memory kind {kind}")));
        }
        if count == 0 || count > MAX_GRANULES || b.len() != HEADER_BYTES + GRANULE_BYTES * count as usize {
            return Err(bad(&format!("{count} granules in {} bytes", b.len())));
        }
        // Checked: the numbers are another process's, and a wrapped sum would pass.
        let fits = granule.checked_mul(count).zip(offset.checked_add(size)).is_some_and(|(room, end)| end <= room);
        // The block may start past the first granule: a chunk is listed whole.
        if !granule.is_power_of_two() || size == 0 || !fits {
            return Err(bad(&format!("block of {size} bytes at offset {offset} does not fit {count} granules of {granule}")));
        }
        let granules = (0..count as usize)
            .map(|i| {
                let at = HEADER_BYTES + GRANULE_BYTES * i;
                let fd = u64_at(at);
                if fd > i32::MAX as u64 {
                    return Err(bad(&format!("granule {i}: descriptor {fd} out of range")));
                }
                Ok(SharedGranule { fd: fd as i32, offset: u64_at(at + 8), file: FileId { dev: u64_at(at + 16), ino: u64_at(at + 24) } })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Descriptor { kind, pid, start_time, record, device, granule, offset, size, origin, handover, flags, granules })
    }
}

/// Raise this process's soft limit on open files to its hard limit, once. Why: an exported
/// granule keeps one descriptor open while it is mapped, so a 4 GiB block holds 2,048,
/// past the usual soft limit of 1,024; the hard limit is what the administrator allows
/// (the Go runtime raises it the same way at start). Programs this process starts inherit
/// the raised limit: a library cannot tell a fork child that will exec from one that goes
/// on with the parent's descriptors (a data loader's worker), which a lowered limit would
/// starve of files.
pub fn raise_fd_limit() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let mut l = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: a writable struct, then the same struct back.
        unsafe {
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) == 0 && l.rlim_cur < l.rlim_max {
                l.rlim_cur = l.rlim_max;
                libc::setrlimit(libc::RLIMIT_NOFILE, &l);
            }
        }
    });
}

/// Held from the moment a descriptor exists without close-on-exec until it is marked so.
/// `crate::fork`'s prepare handler takes it too (after the pool locks), so `fork()` waits
/// for the window to close and no child starts with such a descriptor open.
static CLOEXEC_WINDOW: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Run `make`, which creates a descriptor without close-on-exec (the driver's export of a
/// shareable handle cannot ask for the flag), and mark what it returns close-on-exec, with
/// `fork()` held off in between: a thread that forks meanwhile (and then execs) gives its
/// child no copy of it. Spawns that run no fork handlers (`posix_spawn`, `vfork`) are not
/// held off (docs/ipc.md).
pub fn new_fd_cloexec<E>(make: impl FnOnce() -> std::result::Result<i32, E>) -> std::result::Result<i32, E> {
    let _window = hold_cloexec_window();
    let fd = make()?;
    set_cloexec(fd);
    Ok(fd)
}

/// The close-on-exec window's lock (`new_fd_cloexec`), for the fork handlers to hold across
/// a fork. It guards no data, so a poisoned lock is taken as it is.
pub fn hold_cloexec_window() -> std::sync::MutexGuard<'static, ()> {
    CLOEXEC_WINDOW.lock().unwrap_or_else(|e| e.into_inner())
}

/// Mark `fd` close-on-exec, so an exported granule's descriptor does not leak into the
/// programs this process starts (the driver's export does not set it).
pub fn set_cloexec(fd: i32) {
    // SAFETY: flag calls on a descriptor this process owns.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFD);
        if flags >= 0 {
            libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
        }
    }
}

/// An exporter, opened by an importer to fetch descriptors from: a pidfd of the process
/// (which says when it has exited, and fetches its descriptors) and the exporter's record
/// of its exports, checked to be that process's. Kept between imports by the
/// importer's cache (`pool::import_cache`), so a message of many blocks opens its exporter
/// once.
#[derive(Debug)]
pub struct Exporter {
    pub pid: u32,
    pub start_time: u64,
    pidfd: Fd,
    record: Fd,
    /// The record's descriptor number in the exporter.
    record_fd: i32,
    /// The identity of the record's file (a memfd: unique while it exists).
    record_file: FileId,
}

impl Exporter {
    /// Open the exporter of `d`: a process holding its pid that started at another time is
    /// not the exporter (refused).
    pub fn open(d: &Descriptor) -> Result<Exporter> {
        let pid = d.pid;
        // SAFETY: a plain syscall with integer arguments.
        let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        if pidfd < 0 {
            return Err(fetch_error(pid, "pidfd_open"));
        }
        let pidfd = Fd(pidfd as i32);
        // Read after the pidfd pins the process: if it is the exporter, it stays so.
        still_the_exporter(d)?;
        // SAFETY: as above; the result is a new descriptor this process owns.
        let record = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.raw(), d.record.fd, 0) };
        if record < 0 {
            return Err(fetch_error(pid, &format!("pidfd_getfd of its export record (descriptor {})", d.record.fd)));
        }
        let record = Fd(record as i32);
        ExportRecord::check(&record, pid, d.start_time)?;
        let record_file = FileId::of(record.raw())?;
        Ok(Exporter { pid, start_time: d.start_time, pidfd, record, record_fd: d.record.fd, record_file })
    }

    /// Whether the exporter still holds the record this importer opened: an `exec` keeps
    /// the pid and start time but closes the record (close-on-exec), and a later one may
    /// take its number. `kcmp` compares the two open files; where the kernel refuses it,
    /// the number is fetched again and its file compared.
    pub fn same_record(&self) -> bool {
        const KCMP_FILE: libc::c_long = 0;
        // SAFETY: a plain syscall with integer arguments.
        let r = unsafe {
            libc::syscall(libc::SYS_kcmp, std::process::id() as libc::c_long, self.pid as libc::c_long, KCMP_FILE, self.record.raw() as libc::c_long, self.record_fd as libc::c_long)
        };
        if r >= 0 {
            return r == 0;
        }
        // SAFETY: as in `open`; the result is a new descriptor this process owns.
        let again = unsafe { libc::syscall(libc::SYS_pidfd_getfd, self.pidfd.raw(), self.record_fd, 0) };
        if again < 0 {
            return false;
        }
        let again = Fd(again as i32);
        FileId::of(again.raw()).is_ok_and(|f| f == self.record_file)
    }

    /// Count an open import of export `at` in the exporter's opens file (`OpenMark`).
    pub fn mark_open(&self, at: RecordRef) -> Result<OpenMark> {
        let theirs = ExportRecord::opens_fd_at(&self.record)
            .ok_or_else(|| Error::InvalidArgument(format!("IPC import: the export record of process {} cannot be read", self.pid)))?;
        // SAFETY: as in `open`; the result is a new descriptor this process owns.
        let mine = unsafe { libc::syscall(libc::SYS_pidfd_getfd, self.pidfd.raw(), theirs, 0) };
        if mine < 0 {
            return Err(fetch_error(self.pid, &format!("pidfd_getfd of its opens file (descriptor {theirs})")));
        }
        OpenMark::new(Fd(mine as i32).raw(), at.slot, self.pid)
    }

    /// Whether `d` comes from this exporter (same process, same record).
    pub fn is_of(&self, d: &Descriptor) -> bool {
        self.pid == d.pid && self.start_time == d.start_time && self.record_fd == d.record.fd
    }

    /// Whether the exporter has exited (its pidfd reads as ready).
    pub fn exited(&self) -> bool {
        let mut p = libc::pollfd { fd: self.pidfd.raw(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one pollfd, no wait.
        unsafe { libc::poll(&mut p, 1, 0) == 1 && p.revents != 0 }
    }

    /// How many exported granules the exporter has released so far (`ExportRecord`); None
    /// where the record cannot be read.
    pub fn releases(&self) -> Option<u64> {
        ExportRecord::releases_at(&self.record)
    }

    /// The exporter still records export `at` of exactly `granules` (else: refused, saying
    /// why).
    pub fn still_exports(&self, at: RecordRef, granules: &[SharedGranule]) -> Result<()> {
        let pid = self.pid;
        match ExportRecord::entry_at(&self.record, at.slot) {
            Some((token, _)) if token != at.token || token == 0 => Err(Error::InvalidArgument(format!(
                "IPC import: process {pid} no longer exports this block (the descriptor is stale: the block was \
                 freed, or its memory released, after the export)"
            ))),
            Some((_, digest)) if digest != granules_digest(granules) => Err(Error::InvalidArgument(format!(
                "IPC import: the descriptor's granules are not the ones process {pid} exported under its token \
                 (a forged or altered descriptor)"
            ))),
            Some(_) => Ok(()),
            None => Err(Error::InvalidArgument(format!("IPC import: the export record of process {pid} cannot be read"))),
        }
    }

    /// This process's copy of the exporter's descriptor `theirs` (granule `i`).
    fn fetch(&self, i: usize, theirs: i32) -> Result<Fd> {
        // SAFETY: as in `open`; the result is a new descriptor this process owns.
        let mine = unsafe { libc::syscall(libc::SYS_pidfd_getfd, self.pidfd.raw(), theirs, 0) };
        if mine < 0 {
            return Err(fetch_error(self.pid, &format!("pidfd_getfd of descriptor {theirs} (granule {i})")));
        }
        Ok(Fd(mine as i32))
    }
}

/// Where an importer's copies of the exporter's descriptors come from.
pub enum FdSource<'a> {
    /// The caller's own, one per granule in the descriptor's order (`Descriptor::per_granule`
    /// makes them so); they stay the caller's.
    Given(std::borrow::Cow<'a, [i32]>),
    /// Copied out of the exporter (`pidfd_getfd`) one at a time, each closed once its
    /// granule is mapped: the mapping keeps the memory. `at`: this export's slot and token
    /// in the exporter's record, and `granules` the list it recorded.
    Fetch { exporter: std::sync::Arc<Exporter>, at: RecordRef, granules: &'a [SharedGranule] },
}

impl<'a> FdSource<'a> {
    /// The caller's descriptors, one per granule, where they were given.
    pub fn given(&self) -> Option<&[i32]> {
        match self {
            FdSource::Given(fds) => Some(fds),
            FdSource::Fetch { .. } => None,
        }
    }

    /// Open the exporter of `d` to fetch its descriptors from: a process holding its pid
    /// that started at another time is not the exporter, and an export the exporter no
    /// longer records (its block freed) is not fetched from. Both refused.
    pub fn fetch_from(d: &'a Descriptor) -> Result<FdSource<'a>> {
        Self::fetch_via(std::sync::Arc::new(Exporter::open(d)?), d)
    }

    /// As `fetch_from`, through an exporter already open.
    pub fn fetch_via(exporter: std::sync::Arc<Exporter>, d: &'a Descriptor) -> Result<FdSource<'a>> {
        exporter.still_exports(d.record, &d.granules)?;
        Ok(FdSource::Fetch { exporter, at: d.record, granules: &d.granules })
    }

    /// This process's descriptor for granule `i`, shared as `theirs`, and the guard that
    /// closes it if it was fetched (keep it until the granule is mapped). Refused where the
    /// file is not the one exported (`FileId`): a stale or forged descriptor.
    pub fn get(&self, i: usize, theirs: &SharedGranule) -> Result<(i32, Option<Fd>)> {
        let (fd, guard) = match self {
            FdSource::Given(fds) => fds.get(i).map(|&fd| (fd, None)).ok_or_else(|| {
                Error::InvalidArgument(format!("IPC import: {} descriptors passed, granule {i} has none", fds.len()))
            })?,
            FdSource::Fetch { exporter, at, granules } => {
                let fetched = exporter.fetch(i, theirs.fd)?;
                // Still recorded after the fetch: the descriptor was the export's then (the
                // exporter clears the record before it closes an exported descriptor).
                exporter.still_exports(*at, granules)?;
                (fetched.raw(), Some(fetched))
            }
        };
        let got = FileId::of(fd)?;
        if got != theirs.file {
            return Err(Error::InvalidArgument(format!(
                "IPC import: granule {i}'s descriptor {} is not the file the exporter shared (device {}, inode {}; found \
                 device {}, inode {}): the descriptor is stale (its block was freed and the number reused) or forged",
                theirs.fd, theirs.file.dev, theirs.file.ino, got.dev, got.ino
            )));
        }
        Ok((fd, guard))
    }
}

/// The process holding `d`'s pid is its exporter: it started when the exporter did (else
/// the exporter is gone and its pid was reused: refused, saying so).
pub fn still_the_exporter(d: &Descriptor) -> Result<()> {
    let now = start_time_of(d.pid);
    if now != d.start_time {
        return Err(Error::InvalidArgument(format!(
            "IPC import: process {} is not the exporter (it started at tick {now}, the exporter at {}): the exporter is \
             gone and its pid was reused; its blocks are no longer shared",
            d.pid, d.start_time
        )));
    }
    Ok(())
}

/// The checks an importer that fetches by pid makes (`Exporter::open` and
/// `FdSource::fetch_via`), for descriptors its exporter's handover thread handed over
/// instead (`share::handover::take_export`): the process holding the pid is the exporter
/// (its start time), `record` is that exporter's export record, and the record still holds
/// the descriptor's token beside the digest of its granule list (an altered descriptor is
/// refused).
pub fn check_handed(d: &Descriptor, record: std::os::fd::OwnedFd) -> Result<Fd> {
    use std::os::fd::IntoRawFd;
    still_the_exporter(d)?;
    let record = Fd(record.into_raw_fd());
    ExportRecord::check(&record, d.pid, d.start_time)?;
    still_handed(d, &record)?;
    Ok(record)
}

/// The exporter's record `record` (checked by `check_handed`) still holds export `d`.
pub fn still_handed(d: &Descriptor, record: &Fd) -> Result<()> {
    let pid = d.pid;
    match ExportRecord::entry_at(record, d.record.slot) {
        Some((token, _)) if token != d.record.token || token == 0 => Err(Error::InvalidArgument(format!(
            "IPC import: process {pid} no longer exports this block (the descriptor is stale: the block was freed, or its \
             memory released, after the export)"
        ))),
        Some((_, digest)) if digest != granules_digest(&d.granules) => Err(Error::InvalidArgument(format!(
            "IPC import: the descriptor's granules are not the ones process {pid} exported under its token (a forged or \
             altered descriptor)"
        ))),
        Some(_) => Ok(()),
        None => Err(Error::InvalidArgument(format!("IPC import: the export record of process {pid} cannot be read"))),
    }
}

fn fetch_error(pid: u32, what: &str) -> Error {
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::ESRCH) => Error::InvalidArgument(format!(
            "IPC import: {what} of process {pid} failed: the exporter has exited, and its blocks are no longer shared"
        )),
        Some(libc::EBADF) => Error::InvalidArgument(format!(
            "IPC import: {what} of process {pid} failed: the exporter no longer holds that descriptor (the block was \
             freed or its memory released after the export: a stale descriptor)"
        )),
        Some(libc::EPERM | libc::EACCES | libc::ENOSYS) => Error::FetchRefused {
            pid,
            detail: format!(
                "IPC import: {what} of process {pid} was refused: {e} (a container's seccomp profile or Yama's \
                 ptrace_scope forbids copying another process's descriptors)"
            ),
        },
        _ => Error::InvalidArgument(format!("IPC import: {what} of process {pid} failed: {e}")),
    }
}

#[cfg(test)]
mod tests;
