//! An importer's mark in its exporter's opens file (`upstream::export_record`, module docs):
//! one more open import of an export while the mark lives, so that the exporter's pause of
//! that memory refuses, naming this process, until the import is closed.
//!
//! Each exporter's opens file is mapped once in this process and kept while any mark or
//! later import may use it: a mapping per import would cost an `mmap` and a `munmap`
//! (a TLB shootdown over every thread of the process) on each open and close.

use super::super::export_record::{OPENS_BYTES, OPENS_WORDS};
use super::identity::FileId;
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

/// An exporter's opens file, mapped shared.
struct OpensFile {
    base: *mut AtomicU32,
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

/// The opens files mapped here, by file (a memfd's identity is unique while it exists).
static MAPPED: Mutex<Option<HashMap<(u64, u64), Arc<OpensFile>>>> = Mutex::new(None);

/// The mapping of the opens file `fd` (this process's descriptor of it), made once.
fn map(fd: i32) -> Result<Arc<OpensFile>> {
    let file = FileId::of(fd)?;
    let file = (file.dev, file.ino);
    let mut g = MAPPED.lock().unwrap_or_else(|e| e.into_inner());
    let files = g.get_or_insert_with(HashMap::new);
    if let Some(f) = files.get(&file) {
        return Ok(f.clone());
    }
    // SAFETY: a shared mapping of the exporter's file, which is sealed against shrinking
    // (no SIGBUS) and has this size.
    let base = unsafe { libc::mmap(std::ptr::null_mut(), OPENS_BYTES, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0) };
    if base == libc::MAP_FAILED {
        return Err(Error::InvalidArgument(format!("IPC import: the exporter's opens file cannot be mapped: {}", std::io::Error::last_os_error())));
    }
    // Files no mark uses any more go (their exporters' marks were all dropped).
    files.retain(|_, f| Arc::strong_count(f) > 1);
    let f = Arc::new(OpensFile { base: base.cast() });
    files.insert(file, f.clone());
    Ok(f)
}

/// One open import counted in an exporter's opens file; the count drops with the mark.
pub struct OpenMark {
    file: Arc<OpensFile>,
    /// The slot's first word.
    at: usize,
}

impl OpenMark {
    /// Count an open import of export slot `slot` in the opens file `fd` (this process's
    /// descriptor of it; the caller closes it).
    pub fn new(fd: i32, slot: u32) -> Result<OpenMark> {
        let at = OPENS_WORDS * slot as usize;
        if 4 * (at + OPENS_WORDS) > OPENS_BYTES {
            return Err(Error::InvalidArgument(format!("IPC import: export slot {slot} lies outside the opens file")));
        }
        let mark = OpenMark { file: map(fd)?, at };
        mark.word(0).fetch_add(1, Ordering::AcqRel);
        mark.word(1).store(std::process::id(), Ordering::Release);
        Ok(mark)
    }

    fn word(&self, k: usize) -> &AtomicU32 {
        // SAFETY: within the mapping `file` holds (checked in `new`); 4-byte aligned.
        unsafe { &*self.file.base.add(self.at + k) }
    }
}

impl Drop for OpenMark {
    fn drop(&mut self) {
        // Never below zero: the exporter clears the slot when the export ends, and a close
        // after that must not take an open away from the slot's next export.
        let _ = self.word(0).fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }
}
