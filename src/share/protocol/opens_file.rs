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
//! After the slots, the *keepers*: receivers that keep idle mappings of this memory for
//! later messages (Note [Keeping imports mapped]) while no import of it is open, so that
//! their re-sends cost no driver call. A word the exporter bumps (and wakes futex waiters
//! on) when it releases exported memory, then `KEEPERS` entries (a keeper's pid in the high
//! 32 bits, the idle mappings it keeps of this exporter's memory in the low 32 bits), each
//! held by its keeper through a shared lock on byte `slots + entry`, as the slots are:
//! - a receiver claims an entry (its lock first, then the word) when it first maps this
//!   exporter's pausable memory to keep it, adds one per idle mapping kept and
//!   takes it back when the mapping is opened again or dropped, and watches the wake word;
//! - a pause, once it released the memory (the export record's release count moved, so
//!   every kept mapping of the exporter is stale), bumps the word, wakes the keepers and
//!   waits for every live keeper's count to reach zero: each drops its idle mappings then,
//!   and the device gets the memory back before the pause returns (after
//!   `share::keepers::KEEPERS_WAIT` it returns anyway, warning; what a keeper that did not
//!   answer keeps stays alive until it drops it).
//!
//! Limitations: a `fork()` child of a receiver shares the description its locks are held
//! through, so a receiver that dies while such a child lives still counts until the child
//! exits. A pause over every device marks all devices' exports closing before any pauses,
//! but locks one device at a time: a block exported and opened meanwhile can still refuse a
//! later device's pause after earlier ones paused (the Python wrapper resumes those).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Bytes per slot.
pub const SLOT_BYTES: usize = 16;
/// Keeper entries after the slots (module docs).
pub const KEEPERS: u32 = 255;
/// Bytes of a file of `slots` slots: the slots, the wake word and the keepers.
pub const fn file_bytes(slots: u32) -> usize {
    SLOT_BYTES * slots as usize + 8 * (1 + KEEPERS as usize)
}
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

/// The keepers region of a mapped opens file of `slots` slots (module docs).
pub struct Keepers<'a> {
    wake: &'a AtomicU32,
    entries: &'a [AtomicU64],
    slots: u32,
}

const KEEPER_COUNT: u64 = u32::MAX as u64;

impl<'a> Keepers<'a> {
    /// The keepers of the file of `slots` slots mapped at `base`.
    ///
    /// # Safety
    /// `base` must be a live shared mapping of `file_bytes(slots)` bytes, 8-byte aligned.
    pub unsafe fn at(base: *mut u8, slots: u32) -> Keepers<'a> {
        let region = base.add(SLOT_BYTES * slots as usize);
        Keepers {
            wake: &*region.cast::<AtomicU32>(),
            entries: std::slice::from_raw_parts(region.add(8).cast::<AtomicU64>(), KEEPERS as usize),
            slots,
        }
    }

    /// The lock byte of entry `i`.
    fn lock_byte(&self, i: u32) -> u32 {
        self.slots + i
    }

    /// Keeper: claim an entry for this process through `own` (an open file description of
    /// its own, which holds the entry's lock from here on): a free one, or one whose keeper
    /// died (no lock held on it). None where every entry is held.
    pub fn claim(&self, own: i32) -> Option<u32> {
        let me = (std::process::id() as u64) << 32;
        for i in 0..KEEPERS {
            let was = self.entries[i as usize].load(Ordering::Acquire);
            if was != 0 && locked(own, self.lock_byte(i)) {
                continue;
            }
            // The lock first: an entry the exporter reads always has a live holder.
            if !hold(own, self.lock_byte(i), true) {
                return None;
            }
            if self.entries[i as usize].compare_exchange(was, me, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                return Some(i);
            }
            hold(own, self.lock_byte(i), false);
        }
        None
    }

    /// Keeper: one more (`true`) or one fewer idle mapping kept under entry `i`.
    pub fn count(&self, i: u32, more: bool) {
        let e = &self.entries[i as usize];
        if more {
            e.fetch_add(1, Ordering::AcqRel);
        } else {
            let _ = e.fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| (v & KEEPER_COUNT != 0).then(|| v - 1));
        }
    }

    /// Keeper: the wake word now (what `wait` compares against).
    pub fn wake_word(&self) -> u32 {
        self.wake.load(Ordering::Acquire)
    }

    /// Keeper: sleep until the wake word moves from `seen`, or `timeout` passes.
    pub fn wait(&self, seen: u32, timeout: std::time::Duration) {
        let ts = libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as libc::c_long };
        // SAFETY: FUTEX_WAIT on a word of a live shared mapping (not private: other
        // processes wake it), with a relative timeout.
        unsafe {
            libc::syscall(libc::SYS_futex, self.wake as *const AtomicU32, libc::FUTEX_WAIT, seen, &ts as *const libc::timespec, 0usize, 0u32);
        }
    }

    /// Exporter: the memory was released; every keeper wakes to drop what it keeps.
    pub fn wake_all(&self) {
        self.wake.fetch_add(1, Ordering::AcqRel);
        // SAFETY: FUTEX_WAKE on a word of a live shared mapping.
        unsafe {
            libc::syscall(libc::SYS_futex, self.wake as *const AtomicU32, libc::FUTEX_WAKE, i32::MAX, 0usize, 0usize, 0u32);
        }
    }

    /// Exporter: the keepers that still keep idle mappings, as (pid, mappings), asked
    /// through `own` (the exporter's description, which holds no lock): an entry whose
    /// keeper died counts no more.
    pub fn keeping(&self, own: i32) -> Vec<(u32, u32)> {
        (0..KEEPERS)
            .filter_map(|i| {
                let v = self.entries[i as usize].load(Ordering::Acquire);
                (v & KEEPER_COUNT != 0 && locked(own, self.lock_byte(i))).then_some(((v >> 32) as u32, (v & KEEPER_COUNT) as u32))
            })
            .collect()
    }
}
