//! The opens file beside an exporter's record (`record.rs`): per export slot, how many
//! imports of the export other processes have open, so that a pause of that memory refuses
//! while any does (a pause would give the device nothing back and leave the receivers
//! reading memory the resume no longer updates).
//!
//! Per slot, 16 bytes: a state word (the slot's generation in the high 32 bits, bit 31
//! "closing", the open count in bits 0-30) and the pid of the last process that opened one.
//! - The exporter bumps the generation and zeroes the rest when the slot's export ends: a
//!   mark of the old export (its generation) then changes nothing.
//! - An importer adds one before it maps (refused while "closing") and takes it back at its
//!   close; it also holds a shared `F_OFD_SETLK` lock on byte `slot` of the file through an
//!   open file description of its own, which the kernel drops when the process dies: a
//!   count left by a receiver that crashed is told from a live one by that lock alone.
//! - A pause sets "closing" on each of its exports' slots whose count is zero (or whose
//!   lock no process holds any more), and refuses, undoing those it set, where a live count
//!   remains; the slot's export ends with the pause's release, which clears the bit.
//! - An importer checks, once counted, that the export is still live: a pause that ran
//!   between its check of the descriptor and its count ended the export (and moved the slot
//!   to a new generation), and the import is refused.
//!
//! Limitations: a `fork()` child of a receiver shares the description its locks are held
//! through, so a receiver that dies while such a child lives still counts until the child
//! exits. A pause over every device marks all devices' exports closing before any pauses,
//! but locks one device at a time: a block exported and opened meanwhile can still refuse a
//! later device's pause after earlier ones paused (the Python wrapper resumes those).

use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes per slot.
pub const SLOT_BYTES: usize = 16;
const COUNT: u64 = (1 << 31) - 1;
const CLOSING: u64 = 1 << 31;

/// One slot's words in a mapping of the file.
pub struct OpensSlot<'a> {
    state: &'a AtomicU64,
    pid: &'a AtomicU64,
}

impl<'a> OpensSlot<'a> {
    /// Slot `slot` of the file mapped at `base`, `len` bytes (None past its end).
    ///
    /// # Safety
    /// `base` must be a live shared mapping of `len` bytes, 8-byte aligned.
    pub unsafe fn at(base: *mut u8, len: usize, slot: u32) -> Option<OpensSlot<'a>> {
        let off = SLOT_BYTES * slot as usize;
        if off + SLOT_BYTES > len {
            return None;
        }
        let w = base.add(off).cast::<AtomicU64>();
        Some(OpensSlot { state: &*w, pid: &*w.add(1) })
    }

    /// The slot's export ended: a new generation, nothing open, not closing.
    pub fn reset(&self) {
        let s = self.state.load(Ordering::Acquire);
        self.state.store(((s >> 32).wrapping_add(1)) << 32, Ordering::Release);
    }

    /// (open count, last opener's pid).
    pub fn opens(&self) -> (u32, u32) {
        ((self.state.load(Ordering::Acquire) & COUNT) as u32, self.pid.load(Ordering::Acquire) as u32)
    }

    /// Importer: one more open import; returns the generation it counts in, or `None`
    /// while the exporter is pausing the memory.
    pub fn open(&self) -> Option<u32> {
        let mut s = self.state.load(Ordering::Acquire);
        loop {
            if s & CLOSING != 0 {
                return None;
            }
            match self.state.compare_exchange_weak(s, s + 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    // Named after it counts: a refused opener never names itself.
                    self.pid.store(std::process::id() as u64, Ordering::Release);
                    return Some((s >> 32) as u32);
                }
                Err(now) => s = now,
            }
        }
    }

    /// Importer: the import counted in `generation` closed (nothing where the slot has
    /// moved on to another export).
    pub fn close(&self, generation: u32) {
        let mut s = self.state.load(Ordering::Acquire);
        while (s >> 32) as u32 == generation && s & COUNT != 0 {
            match self.state.compare_exchange_weak(s, s - 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return,
                Err(now) => s = now,
            }
        }
    }

    /// Exporter: mark the slot closing where nothing live is open (`live`: whether a
    /// process holds the slot's lock); a stale count (its process gone) is dropped. Returns
    /// false, changing nothing, where a live import is open.
    pub fn close_for_pause(&self, live: impl Fn() -> bool) -> bool {
        let mut s = self.state.load(Ordering::Acquire);
        loop {
            if s & COUNT != 0 && live() {
                return false;
            }
            let closing = (s & !COUNT) | CLOSING;
            match self.state.compare_exchange_weak(s, closing, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(now) => s = now,
            }
        }
    }

    /// Exporter: the pause did not go ahead; imports may open again.
    pub fn reopen(&self) {
        self.state.fetch_and(!CLOSING, Ordering::AcqRel);
    }
}

/// Whether a process holds a lock on byte `slot` of the file `fd` (asked through the
/// exporter's own open file description, which holds none).
pub fn locked(fd: i32, slot: u32) -> bool {
    let mut l: libc::flock = unsafe { std::mem::zeroed() };
    l.l_type = libc::F_WRLCK as _;
    l.l_whence = libc::SEEK_SET as _;
    l.l_start = slot as libc::off_t;
    l.l_len = 1;
    // SAFETY: fcntl with a valid flock.
    let r = unsafe { libc::fcntl(fd, libc::F_OFD_GETLK, &mut l) };
    // A failed query counts as held: refusing is the safe answer.
    r != 0 || l.l_type != libc::F_UNLCK as _
}

/// Take (`true`) or drop the shared lock on byte `slot` through `fd`, an open file
/// description of this process's own.
pub fn hold(fd: i32, slot: u32, take: bool) -> bool {
    let mut l: libc::flock = unsafe { std::mem::zeroed() };
    l.l_type = if take { libc::F_RDLCK } else { libc::F_UNLCK } as _;
    l.l_whence = libc::SEEK_SET as _;
    l.l_start = slot as libc::off_t;
    l.l_len = 1;
    // SAFETY: fcntl with a valid flock.
    unsafe { libc::fcntl(fd, libc::F_OFD_SETLK, &l) == 0 }
}
