//! The exporter's record of its live exports (`ExportRecord`), which importers fetching
//! descriptors by pid check (`share::protocol` says why), and where one export is recorded
//! (`RecordRef`).
//!
//! Layout of the record (a sealed `memfd`, read by importers with `pread`):
//! - a header: magic, pid, start time, the release count, and the number of the opens file
//!   (below). The release count: how many times a granule
//!   that may have been exported has been released (the upstream says so for every granule
//!   with a shareable descriptor; the host upstream's stand-in, for every granule). An importer that keeps another process's
//!   memory mapped between messages (`share::import_cache`) trusts its mappings only while
//!   this count is the one it saw when it mapped them: an unchanged count means every
//!   exported file descriptor it fetched still names the allocation it mapped.
//! - per slot, 16 bytes: the export's random token (0 where free) and the digest of its
//!   granule list (`protocol::granules_digest`). The digest binds a descriptor's granules to
//!   its token: a descriptor whose entries were changed names granules its export never
//!   shared, and is refused.
//!
//! Only the exporter writes the record, through a mapping made before the file is sealed
//! against writes, growth and shrinking: an importer holding a copy of the descriptor can
//! neither rewrite tokens nor truncate the file under the exporter (which would kill it with
//! SIGBUS on its next write).
//!
//! Beside it, the *opens file* (a `memfd` sealed against growth and shrinking only): per
//! slot, how many imports of the export are open now and the pid of the last process that
//! opened one. An importer of memory its exporter may pause (`protocol::FLAG_PAUSABLE`, a tag's)
//! adds one while its import is open (`protocol::OpenMark`), so that a pause of that memory
//! refuses while a receiver has an import of it open (`ExportRecord::opens`), instead of
//! releasing memory the receiver keeps alive and sees stale after the resume; receivers that
//! keep closed imports mapped are the opens file's keepers, which the pause asks to let go.

use super::identity::{granules_digest, start_time_of, Fd, SharedGranule};
use crate::error::{Error, Result};
use rustc_hash::FxHashMap;
use super::opens_file;
use std::sync::atomic::{AtomicU64, Ordering};

/// Where a descriptor's export is recorded: the exporter's record descriptor, the slot, the
/// token.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct RecordRef {
    pub fd: i32,
    pub slot: u32,
    pub token: u64,
}

/// This process's record of its live exports. One per process, whatever the device or
/// upstream.
pub struct ExportRecord {
    fd: Fd,
    /// The opens file (module docs, `opens_file`) and its mapping.
    opens: Fd,
    opens_map: *mut u8,
    /// The file mapped shared and writable (`RECORD_BYTES`), made before the seals.
    map: *mut AtomicU64,
    /// The pid the record was made by: a forked child makes its own.
    pid: u32,
    /// Slot -> the granules (descriptor, offset) its export shares.
    live: Vec<Option<Vec<(i32, u64)>>>,
    /// Granule (descriptor, offset) -> the slots whose exports share it: a released granule
    /// ends its exports without a scan of every slot.
    by_granule: FxHashMap<(i32, u64), Vec<u32>>,
    free: Vec<u32>,
}

// SAFETY: the mapping is only reached through the `RECORD` mutex.
unsafe impl Send for ExportRecord {}

const RECORD_MAGIC: u64 = u64::from_le_bytes(*b"GPPEXRE4");
/// Header words: magic, pid, start time, release count, the opens file's number.
const HEADER_WORDS: usize = 5;
const RELEASES_WORD: usize = 3;
const OPENS_FD_WORD: usize = 4;
/// Bytes of the opens file: a slot of `opens_file` per record slot.
pub const OPENS_BYTES: usize = super::opens_file::file_bytes(RECORD_SLOTS);
/// Bytes of its slots, before the keepers: a slot number past them names no slot (a forged
/// descriptor's must not reach the keepers).
pub const SLOTS_BYTES: usize = super::opens_file::SLOT_BYTES * RECORD_SLOTS as usize;
const RECORD_HEADER: usize = 8 * HEADER_WORDS;
/// Words per slot: token, digest.
const SLOT_WORDS: usize = 2;
/// Live exports a process may have at once. A block re-exported with the same granules
/// reuses its export (`share::exports::BlockExports::reusable`), so this bounds blocks shared at once, not
/// sends.
pub const RECORD_SLOTS: u32 = 1 << 16;
const RECORD_BYTES: usize = RECORD_HEADER + 8 * SLOT_WORDS * RECORD_SLOTS as usize;

static RECORD: std::sync::Mutex<Option<ExportRecord>> = std::sync::Mutex::new(None);

impl ExportRecord {
    fn create() -> Result<ExportRecord> {
        let os = |what: &str| Error::InvalidArgument(format!("IPC export: {what} failed: {}", std::io::Error::last_os_error()));
        // SAFETY: a NUL-terminated name; valid flags.
        let fd = unsafe { libc::memfd_create(c"gpupool-exports".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            return Err(os("memfd_create"));
        }
        let fd = Fd(fd);
        // SAFETY: our own file.
        if unsafe { libc::ftruncate(fd.raw(), RECORD_BYTES as libc::off_t) } != 0 {
            return Err(os("sizing the export record"));
        }
        // SAFETY: a shared mapping of the whole file, which has that size.
        let map = unsafe { libc::mmap(std::ptr::null_mut(), RECORD_BYTES, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.raw(), 0) };
        if map == libc::MAP_FAILED {
            return Err(os("mapping the export record"));
        }
        // Writes through the mapping made above stay allowed; nobody else may write, grow
        // or shrink the file. A kernel without the future-write seal still gets the size
        // seals, which keep the exporter from SIGBUS.
        let size_seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
        // SAFETY: fcntl on our own descriptor.
        unsafe {
            if libc::fcntl(fd.raw(), libc::F_ADD_SEALS, size_seals | libc::F_SEAL_FUTURE_WRITE | libc::F_SEAL_SEAL) != 0 {
                libc::fcntl(fd.raw(), libc::F_ADD_SEALS, size_seals | libc::F_SEAL_SEAL);
            }
        }
        let (opens, opens_map) = Self::create_opens()?;
        let pid = std::process::id();
        let opens_fd = opens.raw() as u64;
        let r = ExportRecord { fd, opens, opens_map, map: map.cast(), pid, live: Vec::new(), by_granule: FxHashMap::default(), free: Vec::new() };
        for (i, v) in [RECORD_MAGIC, pid as u64, start_time_of(pid), 0, opens_fd].into_iter().enumerate() {
            r.word(i).store(v, Ordering::Release);
        }
        Ok(r)
    }

    /// The opens file, mapped: importers write it, so it is sealed against growth and
    /// shrinking only (a truncation would kill the exporter with SIGBUS on its next read).
    fn create_opens() -> Result<(Fd, *mut u8)> {
        let os = |what: &str| Error::InvalidArgument(format!("IPC export: {what} failed: {}", std::io::Error::last_os_error()));
        // SAFETY: a NUL-terminated name; valid flags.
        let fd = unsafe { libc::memfd_create(c"gpupool-opens".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            return Err(os("memfd_create (opens)"));
        }
        let fd = Fd(fd);
        // SAFETY: our own file; a shared mapping of all of it once sized.
        unsafe {
            if libc::ftruncate(fd.raw(), OPENS_BYTES as libc::off_t) != 0 {
                return Err(os("sizing the opens file"));
            }
            let map = libc::mmap(std::ptr::null_mut(), OPENS_BYTES, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.raw(), 0);
            if map == libc::MAP_FAILED {
                return Err(os("mapping the opens file"));
            }
            libc::fcntl(fd.raw(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL);
            Ok((fd, map.cast()))
        }
    }

    fn opens_slot(&self, slot: u32) -> opens_file::OpensSlot<'_> {
        // SAFETY: the mapping of the whole opens file, which lives as long as `self`.
        unsafe { opens_file::OpensSlot::at(self.opens_map, SLOTS_BYTES, slot) }.expect("a record slot has an opens slot")
    }

    /// The live exports among `ats` (of this process's record).
    fn live_among<'a>(&'a self, ats: &'a [RecordRef]) -> impl Iterator<Item = RecordRef> + 'a {
        ats.iter().copied().filter(move |at| {
            self.pid == std::process::id() && self.fd.raw() == at.fd && at.slot < RECORD_SLOTS
                && self.slot_word(at.slot, 0).load(Ordering::Acquire) == at.token
        })
    }

    /// Before a pause of the memory exports `ats` share: mark each closing, so that no
    /// import opens meanwhile; refused, changing nothing, where another process still has
    /// one open (a count whose lock a live process holds, `opens_file`): then the open ones,
    /// as (export, open count, the last opener's pid).
    pub fn close_for_pause(ats: &[RecordRef]) -> std::result::Result<(), Vec<(RecordRef, u32, u32)>> {
        let g = RECORD.lock().unwrap_or_else(|e| e.into_inner());
        let Some(r) = g.as_ref() else { return Ok(()) };
        let mut closed = Vec::new();
        let mut open = Vec::new();
        for at in r.live_among(ats) {
            let slot = r.opens_slot(at.slot);
            if slot.close_for_pause(|| opens_file::locked(r.opens.raw(), at.slot)) {
                closed.push(at);
            } else {
                let (n, pid) = slot.opens();
                open.push((at, n, pid));
            }
        }
        if open.is_empty() {
            return Ok(());
        }
        for at in closed {
            r.opens_slot(at.slot).reopen();
        }
        Err(open)
    }

    /// The pause that `close_for_pause` prepared for did not go ahead: imports of `ats`
    /// may open again.
    pub fn reopen(ats: &[RecordRef]) {
        let g = RECORD.lock().unwrap_or_else(|e| e.into_inner());
        let Some(r) = g.as_ref() else { return };
        for at in r.live_among(ats) {
            r.opens_slot(at.slot).reopen();
        }
    }

    /// This process's release count (None: it has no record).
    pub fn own_releases() -> Option<u64> {
        let g = RECORD.lock().unwrap_or_else(|e| e.into_inner());
        g.as_ref().filter(|r| r.pid == std::process::id()).map(|r| r.word(RELEASES_WORD).load(Ordering::Acquire))
    }

    /// This process's opens file, mapped, and its descriptor: the mapping stays while the
    /// process lives (a record is never dropped, only forgotten by a forked child).
    fn opens_of_own() -> Option<(*mut u8, i32)> {
        let g = RECORD.lock().unwrap_or_else(|e| e.into_inner());
        g.as_ref().filter(|r| r.pid == std::process::id()).map(|r| (r.opens_map, r.opens.raw()))
    }

    /// Exporter: memory was released; the keepers of its idle mappings wake
    /// (`opens_file::Keepers`).
    pub fn wake_keepers() {
        if let Some((map, _)) = Self::opens_of_own() {
            // SAFETY: the whole opens file's mapping, which outlives this call.
            unsafe { opens_file::Keepers::at(map, RECORD_SLOTS) }.wake_all();
        }
    }

    /// Exporter: the live keepers that still keep idle mappings, as (pid, mappings).
    pub fn keeping() -> Vec<(u32, u32)> {
        match Self::opens_of_own() {
            // SAFETY: as in `wake_keepers`.
            Some((map, fd)) => unsafe { opens_file::Keepers::at(map, RECORD_SLOTS) }.keeping(fd),
            None => Vec::new(),
        }
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        debug_assert!(i < RECORD_BYTES / 8);
        // SAFETY: within the mapping, which lives as long as `self`; 8-byte aligned.
        unsafe { &*self.map.add(i) }
    }

    fn slot_word(&self, slot: u32, k: usize) -> &AtomicU64 {
        self.word(HEADER_WORDS + SLOT_WORDS * slot as usize + k)
    }

    /// Run `f` on this process's record, made on first use (and again in a forked child,
    /// whose exports are its own).
    fn with<T>(f: impl FnOnce(&mut ExportRecord) -> Result<T>) -> Result<T> {
        let mut g = RECORD.lock().unwrap_or_else(|e| e.into_inner());
        if !g.as_ref().is_some_and(|r| r.pid == std::process::id()) {
            if let Some(old) = g.take() {
                // The parent's record: not ours to write or to unmap from under the
                // parent's books (the child's copy of the mapping goes with the child).
                std::mem::forget(old);
            }
            *g = Some(ExportRecord::create()?);
        }
        f(g.as_mut().expect("made above"))
    }

    /// Record an export of `granules`; returns where it is.
    pub fn add(granules: &[SharedGranule]) -> Result<RecordRef> {
        let digest = granules_digest(granules);
        Self::with(|r| {
            let slot = match r.free.pop() {
                Some(s) => s,
                None if (r.live.len() as u32) < RECORD_SLOTS => {
                    r.live.push(None);
                    (r.live.len() - 1) as u32
                }
                None => {
                    return Err(Error::InvalidArgument(format!(
                        "IPC export: {RECORD_SLOTS} blocks are exported at once; free some first"
                    )))
                }
            };
            let mut token = 0u64;
            while token == 0 {
                // SAFETY: an 8-byte buffer.
                if unsafe { libc::getrandom((&mut token as *mut u64).cast(), 8, 0) } != 8 {
                    r.free.push(slot);
                    return Err(Error::InvalidArgument("IPC export: getrandom failed".into()));
                }
            }
            // The digest first: a reader that sees the token sees its digest.
            r.slot_word(slot, 1).store(digest, Ordering::Release);
            r.slot_word(slot, 0).store(token, Ordering::Release);
            let shared: Vec<(i32, u64)> = granules.iter().map(|g| (g.fd, g.offset)).collect();
            for &k in &shared {
                let slots = r.by_granule.entry(k).or_default();
                if !slots.contains(&slot) {
                    slots.push(slot);
                }
            }
            r.live[slot as usize] = Some(shared);
            Ok(RecordRef { fd: r.fd.raw(), slot, token })
        })
    }

    /// Whether export `at` is still recorded (its block not freed, its granules not released).
    pub fn is_live(at: RecordRef) -> bool {
        let g = RECORD.lock().unwrap_or_else(|e| e.into_inner());
        g.as_ref().is_some_and(|r| {
            r.pid == std::process::id() && r.fd.raw() == at.fd && at.slot < RECORD_SLOTS && r.slot_word(at.slot, 0).load(Ordering::Acquire) == at.token
        })
    }

    /// A copy of this record's descriptor, then copies of the descriptors export (`slot`,
    /// `token`) shares, each of its numbers once in the order its granule list first names
    /// it; `None` where the export is not live. The importer checks the descriptor it holds
    /// against the record (`protocol::check_handed`) as one that fetched by pid would. Made under the record's lock:
    /// an exported descriptor closes only after its exports are cleared, so the copies
    /// are the export's. The exporter's descriptor thread hands them to an importer that may
    /// not copy them itself (`share::handover::take_export`).
    pub fn handed(slot: u32, token: u64) -> Option<Vec<std::os::fd::OwnedFd>> {
        use std::os::fd::FromRawFd;
        let g = RECORD.lock().unwrap_or_else(|e| e.into_inner());
        let r = g.as_ref().filter(|r| r.pid == std::process::id())?;
        let shared = r.live.get(slot as usize)?.as_ref()?;
        if token == 0 || r.slot_word(slot, 0).load(Ordering::Acquire) != token {
            return None;
        }
        let mut seen = rustc_hash::FxHashSet::default();
        let numbers: Vec<i32> = shared.iter().map(|&(fd, _)| fd).filter(|&fd| seen.insert(fd)).collect();
        let mut out = Vec::with_capacity(numbers.len() + 2);
        // The record first, the opens file last (`handover::take_export` takes both off).
        for fd in std::iter::once(r.fd.raw()).chain(numbers).chain(std::iter::once(r.opens.raw())) {
            // SAFETY: F_DUPFD_CLOEXEC of a descriptor the record keeps open; the copy is ours.
            let c = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
            if c < 0 {
                return None;
            }
            out.push(unsafe { std::os::fd::OwnedFd::from_raw_fd(c) });
        }
        Some(out)
    }

    /// End the export in `slot`; a slot already free stays as it is (an export that lists
    /// a granule twice is found twice when that granule goes, and its slot must go back to
    /// the free list once).
    fn clear(&mut self, slot: u32) {
        let Some(shared) = self.live[slot as usize].take() else { return };
        self.slot_word(slot, 0).store(0, Ordering::Release);
        // The slot's next export starts with no open import, in a new generation.
        self.opens_slot(slot).reset();
        for k in shared {
            if let std::collections::hash_map::Entry::Occupied(mut e) = self.by_granule.entry(k) {
                e.get_mut().retain(|&s| s != slot);
                if e.get().is_empty() {
                    e.remove();
                }
            }
        }
        self.free.push(slot);
    }

    /// Export `at` ended (its block was freed): its slot is cleared, so its descriptor can
    /// no longer be fetched from.
    pub fn end(at: RecordRef) {
        let mut g = RECORD.lock().unwrap_or_else(|e| e.into_inner());
        let Some(r) = g.as_mut().filter(|r| r.pid == std::process::id()) else { return };
        if r.live.get(at.slot as usize).is_some_and(|e| e.is_some()) && r.slot_word(at.slot, 0).load(Ordering::Acquire) == at.token {
            r.clear(at.slot);
        }
    }

    /// The granule shared as (`fd`, `offset`) is about to be released (its descriptor
    /// closed, or its memory given back): every export that shares it ends first, and the
    /// release count moves, so importers drop what they kept mapped of this process.
    pub fn granule_released(fd: i32, offset: u64) {
        let mut g = RECORD.lock().unwrap_or_else(|e| e.into_inner());
        let Some(r) = g.as_mut().filter(|r| r.pid == std::process::id()) else { return };
        r.word(RELEASES_WORD).fetch_add(1, Ordering::AcqRel);
        for slot in r.by_granule.get(&(fd, offset)).cloned().unwrap_or_default() {
            r.clear(slot);
        }
        // Every mapping a keeper keeps of this process's memory is stale now: its watcher
        // drops them (a pause also waits for that; any other release does not).
        // SAFETY: the whole opens file's mapping, which lives as long as the record.
        unsafe { opens_file::Keepers::at(r.opens_map, RECORD_SLOTS) }.wake_all();
    }

    /// An importer's check that `fd` is the record of exporter `pid` started at `start_time`.
    pub(super) fn check(fd: &Fd, pid: u32, start_time: u64) -> Result<()> {
        let mut b = [0u8; RECORD_HEADER];
        // SAFETY: a buffer of the length passed.
        let n = unsafe { libc::pread(fd.raw(), b.as_mut_ptr().cast(), b.len(), 0) };
        let at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        if n != RECORD_HEADER as isize || at(0) != RECORD_MAGIC || at(8) != pid as u64 || at(16) != start_time {
            return Err(Error::InvalidArgument(format!(
                "IPC import: the descriptor's export record is not process {pid}'s (forged or stale descriptor, or an \
                 exporter running another gpupool version)"
            )));
        }
        Ok(())
    }

    fn read_words<const N: usize>(fd: &Fd, at: usize) -> Option<[u64; N]> {
        let mut b = [0u8; 64];
        let len = 8 * N;
        // SAFETY: a buffer of at least the length passed.
        let n = unsafe { libc::pread(fd.raw(), b.as_mut_ptr().cast(), len, at as libc::off_t) };
        (n == len as isize).then(|| std::array::from_fn(|i| u64::from_le_bytes(b[8 * i..8 * i + 8].try_into().expect("8 bytes"))))
    }

    /// The token and digest in `slot` of the record `fd` (None where unreadable).
    pub(super) fn entry_at(fd: &Fd, slot: u32) -> Option<(u64, u64)> {
        if slot >= RECORD_SLOTS {
            return None;
        }
        Self::read_words::<2>(fd, RECORD_HEADER + 8 * SLOT_WORDS * slot as usize).map(|[t, d]| (t, d))
    }

    /// The exporter's number of its opens file, read from the record `fd`.
    pub(super) fn opens_fd_at(fd: &Fd) -> Option<i32> {
        Self::read_words::<1>(fd, 8 * OPENS_FD_WORD).and_then(|[v]| i32::try_from(v).ok())
    }

    /// The release count of the record `fd` (None where unreadable).
    pub(super) fn releases_at(fd: &Fd) -> Option<u64> {
        Self::read_words::<1>(fd, 8 * RELEASES_WORD).map(|[v]| v)
    }
}
