//! An importer's mark in its exporter's opens file (`share::protocol::opens_file` says the
//! protocol): one more open import of an export while the mark lives, taken before the
//! import maps, so that the exporter's pause of that memory refuses, naming this process,
//! until the import is closed.
//!
//! Each exporter's opens file is mapped once in this process, with an open file
//! description of its own that holds this process's locks on the slots it has imports of:
//! a mapping per import would cost an `mmap` and a `munmap` (a TLB shootdown over every
//! thread of the process) on each open and close.

use super::record::{OPENS_BYTES, RECORD_SLOTS, SLOTS_BYTES};
use super::opens_file::{self, Keepers, OpensSlot};
use super::identity::{Fd, FileId};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// An exporter's opens file, mapped shared, and this process's locks on its slots.
struct OpensFile {
    base: *mut u8,
    /// This process's own open file description of the file, which holds the locks.
    own: Fd,
    /// Slot -> this process's marks on it (the lock is held while any is).
    marks: Mutex<HashMap<u32, u32>>,
    /// This process's keeper entry (`opens_file::Keepers`), claimed when it first maps
    /// memory of this exporter's that may be kept idle; held (its lock) while the file is
    /// mapped.
    keeper: Mutex<Option<u32>>,
    /// The file's identity.
    key: FileKey,
}

// SAFETY: the mapping is reached only through atomics and lives as long as the value.
unsafe impl Send for OpensFile {}
unsafe impl Sync for OpensFile {}

impl Drop for OpensFile {
    fn drop(&mut self) {
        // SAFETY: the mapping `map` made, no longer reachable.
        unsafe { libc::munmap(self.base.cast(), OPENS_BYTES) };
    }
}

impl OpensFile {
    fn slot(&self, slot: u32) -> Option<OpensSlot<'_>> {
        // SAFETY: the mapping of the whole file, which lives as long as `self`.
        unsafe { OpensSlot::at(self.base, SLOTS_BYTES, slot) }
    }

    fn keepers(&self) -> Keepers<'_> {
        // SAFETY: the mapping of the whole file (`OPENS_BYTES` is `file_bytes(RECORD_SLOTS)`).
        unsafe { Keepers::at(self.base, RECORD_SLOTS) }
    }
}

/// An opens file's identity: its device and inode (a memfd's is unique while it exists).
type FileKey = (u64, u64);

/// The opens files mapped here, by file.
static MAPPED: Mutex<Option<HashMap<FileKey, Arc<OpensFile>>>> = Mutex::new(None);

/// The mapping of the opens file `fd` (this process's descriptor of it), made once.
fn map(fd: i32) -> Result<Arc<OpensFile>> {
    let bad = |why: String| Error::InvalidArgument(format!("IPC import: the exporter's opens file {why}"));
    let file = FileId::of(fd)?;
    let mut g = MAPPED.lock().unwrap_or_else(|e| e.into_inner());
    let files = g.get_or_insert_with(HashMap::new);
    // Files no mark uses any more go (their exporters' imports were all closed).
    files.retain(|_, f| Arc::strong_count(f) > 1);
    if let Some(f) = files.get(&(file.dev, file.ino)) {
        return Ok(f.clone());
    }
    // A file of another size, or one that may shrink, would kill this process with SIGBUS.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat and fcntl on a descriptor of ours.
    let (sized, seals) = unsafe { (libc::fstat(fd, &mut st) == 0, libc::fcntl(fd, libc::F_GET_SEALS)) };
    if !sized || st.st_size as usize != OPENS_BYTES || seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return Err(bad("is not one (its size or seals differ)".into()));
    }
    // Its own open file description, for locks that are this process's alone.
    let path = std::ffi::CString::new(format!("/proc/self/fd/{fd}")).expect("no NUL");
    // SAFETY: a NUL-terminated path.
    let own = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if own < 0 {
        return Err(bad(format!("cannot be opened again: {}", std::io::Error::last_os_error())));
    }
    let own = Fd(own);
    // SAFETY: a shared mapping of the file, which has this size and may not shrink.
    let base = unsafe { libc::mmap(std::ptr::null_mut(), OPENS_BYTES, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0) };
    if base == libc::MAP_FAILED {
        return Err(bad(format!("cannot be mapped: {}", std::io::Error::last_os_error())));
    }
    let f = Arc::new(OpensFile { base: base.cast(), own, marks: Mutex::new(HashMap::new()), keeper: Mutex::new(None), key: (file.dev, file.ino) });
    files.insert((file.dev, file.ino), f.clone());
    Ok(f)
}

/// One open import counted in an exporter's opens file; the count drops with the mark.
pub struct OpenMark {
    file: Arc<OpensFile>,
    slot: u32,
    generation: u32,
}

impl OpenMark {
    /// Count an open import of export slot `slot` in the opens file `fd` (this process's
    /// descriptor of it; the caller closes it). Refused while the exporter pauses the
    /// memory (`OpenMark::PAUSING` in the message).
    pub fn new(fd: i32, slot: u32, exporter: u32) -> Result<OpenMark> {
        let file = map(fd)?;
        if file.slot(slot).is_none() {
            return Err(Error::InvalidArgument(format!("IPC import: export slot {slot} lies outside the opens file")));
        }
        // The lock first: a count the exporter sees always has a live holder.
        {
            let mut marks = file.marks.lock().unwrap_or_else(|e| e.into_inner());
            let n = marks.entry(slot).or_insert(0);
            if *n == 0 && !opens_file::hold(file.own.raw(), slot, true) {
                marks.remove(&slot);
                return Err(Error::InvalidArgument(format!(
                    "IPC import: locking slot {slot} of the exporter's opens file failed: {}",
                    std::io::Error::last_os_error()
                )));
            }
            *marks.get_mut(&slot).expect("inserted above") += 1;
        }
        let counted = file.slot(slot).and_then(|s| s.open());
        let Some(generation) = counted else {
            release(&file, slot);
            return Err(Error::InvalidArgument(format!(
                "IPC import: process {exporter} {}",
                Self::PAUSING
            )));
        };
        Ok(OpenMark { file, slot, generation })
    }

    /// What the refusal of an import of memory being paused says.
    pub const PAUSING: &'static str = "is pausing this memory (a tag's pause): open it again after the resume";
}

/// One mark of `slot` in `file` went: the lock goes with the last.
fn release(file: &OpensFile, slot: u32) {
    let mut marks = file.marks.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(n) = marks.get_mut(&slot) {
        *n -= 1;
        if *n == 0 {
            marks.remove(&slot);
            opens_file::hold(file.own.raw(), slot, false);
        }
    }
}

impl Drop for OpenMark {
    fn drop(&mut self) {
        if let Some(s) = self.file.slot(self.slot) {
            s.close(self.generation);
        }
        release(&self.file, self.slot);
    }
}

/// This process as a keeper of idle mappings of one exporter's memory, in that exporter's
/// opens file (`opens_file::Keepers`): the exporter's pause waits for what it counts to
/// reach zero, and wakes `wait`.
pub struct Keeper {
    file: Arc<OpensFile>,
    entry: u32,
}

impl std::fmt::Debug for Keeper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Keeper(entry {})", self.entry)
    }
}

impl Keeper {
    /// This process's keeper entry in the opens file `fd` (this process's descriptor of
    /// it; the caller closes it), claimed once per file. None where every entry is held.
    pub fn new(fd: i32) -> Result<Option<Keeper>> {
        let file = map(fd)?;
        let entry = {
            let mut entry = file.keeper.lock().unwrap_or_else(|e| e.into_inner());
            if entry.is_none() {
                *entry = file.keepers().claim(file.own.raw());
            }
            *entry
        };
        Ok(entry.map(|entry| Keeper { file, entry }))
    }

    /// One more (`true`) or one fewer idle mapping kept of this exporter's memory.
    pub fn count(&self, more: bool) {
        self.file.keepers().count(self.entry, more);
    }

    /// The exporter's wake word now.
    pub fn wake_word(&self) -> u32 {
        self.file.keepers().wake_word()
    }

    /// Sleep until the exporter's wake word moves from `seen`, or `timeout` passes.
    pub fn wait(&self, seen: u32, timeout: std::time::Duration) {
        self.file.keepers().wait(seen, timeout)
    }

    /// Which exporter's file it keeps in (device and inode: a memfd's are unique while it
    /// exists).
    pub fn id(&self) -> (u64, u64) {
        self.file.key
    }
}

/// This process's keepers: one per mapped opens file it has claimed an entry in and still
/// keeps a mapping of that exporter's memory under (the file is in use beyond this list).
pub fn keepers() -> Vec<Keeper> {
    let g = MAPPED.lock().unwrap_or_else(|e| e.into_inner());
    let Some(files) = g.as_ref() else { return Vec::new() };
    files
        .values()
        .filter(|f| Arc::strong_count(f) > 1)
        .filter_map(|f| {
            let entry = (*f.keeper.lock().unwrap_or_else(|e| e.into_inner()))?;
            Some(Keeper { file: f.clone(), entry })
        })
        .collect()
}
