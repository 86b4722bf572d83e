//! An importer's mark in its exporter's opens file (`upstream::export_record`, module docs):
//! one more open import of an export while the mark lives, so that the exporter's pause of
//! that memory refuses, naming this process, until the import is closed.

use super::super::export_record::{OPENS_BYTES, OPENS_WORDS};
use crate::error::{Error, Result};
use std::sync::atomic::{AtomicU32, Ordering};

/// One open import counted in an exporter's opens file; the count drops with the mark.
pub struct OpenMark {
    /// The page of the opens file that holds the slot's words, mapped shared.
    page: *mut libc::c_void,
    len: usize,
    /// The slot's first word in that page.
    word: *const AtomicU32,
}

// SAFETY: the mapping is reached only through atomics and lives as long as the mark.
unsafe impl Send for OpenMark {}

impl OpenMark {
    /// Count an open import of export slot `slot` in the opens file `fd` (this process's
    /// descriptor of it; the mapping keeps what it needs, the caller closes `fd`).
    pub fn new(fd: i32, slot: u32) -> Result<OpenMark> {
        let at = 4 * OPENS_WORDS * slot as usize;
        if at + 4 * OPENS_WORDS > OPENS_BYTES {
            return Err(Error::InvalidArgument(format!("IPC import: export slot {slot} lies outside the opens file")));
        }
        // SAFETY: sysconf has no preconditions.
        let page_bytes = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
        let from = at / page_bytes * page_bytes;
        // SAFETY: a shared mapping of one page of the exporter's file, which is sealed
        // against shrinking (no SIGBUS) and has that page.
        let page = unsafe { libc::mmap(std::ptr::null_mut(), page_bytes, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, from as libc::off_t) };
        if page == libc::MAP_FAILED {
            return Err(Error::InvalidArgument(format!(
                "IPC import: the exporter's opens file cannot be mapped: {}",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: within the page just mapped; 4-byte aligned (the slot's words are).
        let word = unsafe { page.cast::<u8>().add(at - from).cast::<AtomicU32>() };
        let mark = OpenMark { page, len: page_bytes, word };
        mark.count().fetch_add(1, Ordering::AcqRel);
        mark.opener().store(std::process::id(), Ordering::Release);
        Ok(mark)
    }

    fn count(&self) -> &AtomicU32 {
        // SAFETY: `word` points into the mapping this mark holds.
        unsafe { &*self.word }
    }

    fn opener(&self) -> &AtomicU32 {
        // SAFETY: as above; the slot's second word.
        unsafe { &*self.word.add(1) }
    }
}

impl Drop for OpenMark {
    fn drop(&mut self) {
        // Never below zero: the exporter clears the slot when the export ends, and a close
        // after that must not take an open away from the slot's next export.
        let _ = self.count().fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        // SAFETY: the page `new` mapped, no longer reached.
        unsafe { libc::munmap(self.page, self.len) };
    }
}
