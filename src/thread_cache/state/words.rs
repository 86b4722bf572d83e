//! The word sets a thread cache shares with its pool: the compare-and-swap protocol on each
//! word (EMPTY, HANDED, REUSABLE, UNFENCED) and the owner thread's private notes that keep
//! its scans short.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicUsize, Ordering};

pub(crate) const EMPTY: usize = 0;
/// Tag bits of kept words (block addresses are at least 256-byte aligned).
pub(crate) const REUSABLE: usize = 1;
pub(crate) const UNFENCED: usize = 2;
const TAGS: usize = REUSABLE | UNFENCED;

/// What a word holds, as the pool sees it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum WordState {
    /// Live, allocated by this thread: its free may be kept.
    Handed,
    /// Freed, reusable by the owner's next allocation of its size.
    Reusable,
    /// Freed by CuPy, waiting for a legacy-stream fence before any reuse.
    Unfenced,
}

fn decode(v: usize) -> Option<(usize, WordState)> {
    match (v & !TAGS, v & TAGS) {
        (0, _) => None,
        (p, 0) => Some((p, WordState::Handed)),
        (p, REUSABLE) => Some((p, WordState::Reusable)),
        (p, _) => Some((p, WordState::Unfenced)),
    }
}

/// A set of words shared with the pool, and the owner's private notes on each.
pub(crate) struct Words<const N: usize> {
    /// EMPTY, HANDED(p) = p, REUSABLE(p) = p | REUSABLE, UNFENCED(p) = p | UNFENCED.
    w: [AtomicUsize; N],
    /// Requested size of each word's block (owner only).
    sizes: UnsafeCell<[usize; N]>,
    /// The stream each word's block was allocated for (owner only): it is kept only when
    /// freed on that stream and reused only for it, so stream order alone protects it.
    streams: UnsafeCell<[usize; N]>,
    /// Next word to overwrite when none is empty (owner only).
    victim: UnsafeCell<usize>,
    /// REUSABLE words the owner may have (owner only; an upper bound, since the pool may
    /// empty some): a miss with none skips the scan, the common case of a churning thread.
    reusable: UnsafeCell<usize>,
    /// Non-empty words as of the owner's last `remember` (owner only; an upper bound): a
    /// free with none skips the scan.
    occupied: UnsafeCell<usize>,
    /// The sizes of this set's last `RECENT` locked allocations (owner only): a block is
    /// remembered only if its size was asked for recently, so a thread whose sizes never
    /// repeat (churn) pays no scans, and its blocks none in the pool (`Live::owner` unset).
    recent: UnsafeCell<([usize; RECENT], usize)>,
}

/// Locked allocations whose sizes `Words::repeats` remembers.
const RECENT: usize = 8;

impl<const N: usize> Words<N> {
    pub(crate) fn new() -> Self {
        Words {
            w: std::array::from_fn(|_| AtomicUsize::new(EMPTY)),
            sizes: UnsafeCell::new([0; N]),
            streams: UnsafeCell::new([0; N]),
            victim: UnsafeCell::new(0),
            reusable: UnsafeCell::new(0),
            occupied: UnsafeCell::new(0),
            recent: UnsafeCell::new(([0; RECENT], 0)),
        }
    }

    /// Pool side: clear HANDED(ptr). `Some(WordState::Handed)`: cleared; another state: the
    /// owner freed it already; `None`: not here.
    pub(crate) fn claim(&self, ptr: usize) -> Option<WordState> {
        for w in &self.w {
            let mut cur = w.load(Ordering::Acquire);
            while cur & !TAGS == ptr {
                if cur != ptr {
                    return decode(cur).map(|h| h.1);
                }
                match w.compare_exchange(ptr, EMPTY, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => return Some(WordState::Handed),
                    Err(now) => cur = now, // the owner freed it meanwhile: look again
                }
            }
        }
        None
    }

    /// Empty every kept word whose state `pick` selects; returns the blocks.
    pub(crate) fn take(&self, pick: impl Fn(WordState) -> bool, out: &mut Vec<(usize, WordState)>) {
        for w in &self.w {
            let cur = w.load(Ordering::Acquire);
            if let Some((p, h)) = decode(cur) {
                if h != WordState::Handed && pick(h) && w.compare_exchange(cur, EMPTY, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                    out.push((p, h));
                }
            }
        }
    }

    pub(crate) fn held(&self) -> impl Iterator<Item = (usize, WordState)> + '_ {
        self.w.iter().filter_map(|w| decode(w.load(Ordering::Acquire)))
    }

    /// Owner: a REUSABLE block of exactly `size` requested bytes on `stream`, now HANDED again.
    // Inlined into the thread cache's malloc: this is the whole of a cached allocation.
    #[inline]
    pub(crate) fn reuse(&self, size: usize, stream: usize) -> Option<usize> {
        // SAFETY: owner thread only (see the `Sync` impl of `ThreadCache`).
        let (sizes, streams, reusable) = unsafe { (&*self.sizes.get(), &*self.streams.get(), &mut *self.reusable.get()) };
        if *reusable == 0 {
            return None;
        }
        let mut seen = 0;
        for ((w, &s), &st) in self.w.iter().zip(sizes).zip(streams) {
            let cur = w.load(Ordering::Relaxed);
            if cur & TAGS == REUSABLE {
                seen += 1;
                if s == size && st == stream && w.compare_exchange(cur, cur & !TAGS, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
                    *reusable -= 1;
                    return Some(cur & !TAGS);
                }
            }
        }
        *reusable = seen;
        None
    }

    /// Owner: take back every REUSABLE word (for the pool to free).
    pub(crate) fn take_reusable(&self, out: &mut Vec<(usize, WordState)>) {
        // SAFETY: owner thread only.
        let reusable = unsafe { &mut *self.reusable.get() };
        if *reusable != 0 {
            self.take(|h| h == WordState::Reusable, out);
            *reusable = 0;
        }
    }

    /// Owner: take back the UNFENCED words whose requested size is not `size`; returns
    /// their count and bytes.
    pub(crate) fn take_unfenced_other_than(&self, size: usize, out: &mut Vec<(usize, WordState)>) -> (usize, usize) {
        // SAFETY: owner thread only.
        let sizes = unsafe { &*self.sizes.get() };
        let mut taken = (0, 0);
        for (w, &s) in self.w.iter().zip(sizes) {
            let cur = w.load(Ordering::Relaxed);
            if cur & TAGS == UNFENCED && s != size && w.compare_exchange(cur, EMPTY, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
                out.push((cur & !TAGS, WordState::Unfenced));
                taken = (taken.0 + 1, taken.1 + s);
            }
        }
        taken
    }

    /// Owner, before a locked allocation of `size`: whether this size was asked for among
    /// the last `RECENT` locked allocations (then the block is worth remembering).
    pub(crate) fn repeats(&self, size: usize) -> bool {
        // SAFETY: owner thread only.
        let (sizes, next) = unsafe { &mut *self.recent.get() };
        let seen = sizes.contains(&size);
        sizes[*next] = size;
        *next = (*next + 1) % RECENT;
        seen
    }

    /// Owner: keep `ptr` (tagged `tag`) if this thread holds it HANDED for `stream`; its size.
    pub(crate) fn keep(&self, ptr: usize, tag: usize, stream: usize) -> Option<usize> {
        // SAFETY: owner thread only.
        let occupied = unsafe { &mut *self.occupied.get() };
        if *occupied == 0 {
            return None;
        }
        let mut seen = 0;
        for (i, w) in self.w.iter().enumerate() {
            let cur = w.load(Ordering::Relaxed);
            if cur == ptr {
                // SAFETY: owner thread only.
                if unsafe { (*self.streams.get())[i] } != stream {
                    return None; // freed on another stream than it was allocated for: the pool's rules apply
                }
                if w.compare_exchange(ptr, ptr | tag, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
                    // SAFETY: owner thread only.
                    unsafe {
                        if tag == REUSABLE {
                            *self.reusable.get() += 1;
                        }
                        return Some((*self.sizes.get())[i]);
                    }
                }
                return None; // the pool claimed it meanwhile
            }
            seen += (cur != EMPTY) as usize;
        }
        // Not here: the scan counted what is (the pool may have emptied words meanwhile).
        *occupied = seen;
        None
    }

    /// Owner: make every UNFENCED word REUSABLE (a fence was just recorded).
    pub(crate) fn fenced(&self) {
        for w in &self.w {
            let cur = w.load(Ordering::Relaxed);
            if cur & TAGS == UNFENCED && w.compare_exchange(cur, (cur & !TAGS) | REUSABLE, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
                // SAFETY: owner thread only.
                unsafe { *self.reusable.get() += 1 };
            }
        }
    }

    /// Owner: make `ptr` eligible for the fast path in an empty word, else in place of the
    /// oldest HANDED one. Kept words are never overwritten (they would be lost to the pool).
    pub(crate) fn remember(&self, ptr: usize, size: usize, stream: usize) {
        // SAFETY: owner thread only.
        let (sizes, streams, victim, occupied) =
            unsafe { (&mut *self.sizes.get(), &mut *self.streams.get(), &mut *self.victim.get(), &mut *self.occupied.get()) };
        *occupied = self.w.iter().filter(|w| w.load(Ordering::Relaxed) != EMPTY).count() + 1;
        let i = match self.w.iter().position(|w| w.load(Ordering::Relaxed) == EMPTY) {
            Some(i) => i,
            None => match (0..N).map(|k| (*victim + k) % N).find(|&i| self.w[i].load(Ordering::Relaxed) & TAGS == 0) {
                Some(i) => {
                    *victim = (i + 1) % N;
                    i
                }
                None => return,
            },
        };
        sizes[i] = size;
        streams[i] = stream;
        // A plain store is enough: the pool only ever clears HANDED words, so whether its
        // claim of the old block lands before or after, the old block simply loses the
        // fast path (a word the pool just emptied is free to take).
        self.w[i].store(ptr, Ordering::Release);
    }
}

