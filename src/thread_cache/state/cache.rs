//! `ThreadCache`: one thread's fast-path state for one device's pool (its two word sets and
//! counters), with the operations the owner thread and the pool each may perform.

use super::words::{WordState, Words, REUSABLE, UNFENCED};
use super::{FENCE_BYTES, MAGAZINE, WORDS};
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// Which word set a block lives in: frees naming a stream (ordered on it), or CuPy's
/// stream-less frees (the magazine). `Live::owner` records it with the cache id.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum WordSet {
    Ordered,
    Unordered,
}


/// One thread's fast-path state for one device's pool.
///
/// On cache lines of its own (`align(128)`: two lines, for the adjacent-line prefetcher):
/// its owner writes its words and counters on every fast operation, and two threads'
/// caches allocated side by side would otherwise slow each other down (false sharing).
#[repr(align(128))]
pub struct ThreadCache {
    pub(crate) ordered: Words<WORDS>,
    pub(crate) unordered: Words<MAGAZINE>,
    /// Owner only: count and bytes of UNFENCED words (an upper bound: the pool may have
    /// emptied some since).
    pub(crate) unfenced: UnsafeCell<(usize, usize)>,
    /// Fast-path allocations and frees (written by the owner, read by the pool's reports).
    pub(crate) fast_allocs: AtomicU64,
    pub(crate) fast_frees: AtomicU64,
    /// Set when the owner thread has exited.
    pub(crate) orphaned: AtomicBool,
    /// The pool's count of orphaned caches, bumped on exit so the pool notices cheaply.
    pub(crate) orphans: Arc<AtomicUsize>,
    /// Set when the pool stops (`Pool::stop`): kept blocks are then not handed out again.
    pub(crate) stopped: Arc<std::sync::atomic::AtomicBool>,
    /// Identity of the pool this cache belongs to, and its index there.
    pub(crate) pool_id: u64,
    pub(crate) id: u32,
}

// SAFETY: the `UnsafeCell`s (`Words::sizes`, `Words::victim`, `unfenced`) are touched only
// by the owner thread (the thread whose TLS holds the cache; the pool never reads them);
// everything else is atomic or immutable.
unsafe impl Sync for ThreadCache {}
unsafe impl Send for ThreadCache {}

fn bump(c: &AtomicU64) {
    // Single writer (the owner): a load and a store, no read-modify-write needed.
    c.store(c.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
}

impl ThreadCache {
    pub fn new(pool_id: u64, id: u32, orphans: Arc<AtomicUsize>, stopped: Arc<std::sync::atomic::AtomicBool>) -> Self {
        ThreadCache {
            ordered: Words::new(),
            unordered: Words::new(),
            unfenced: UnsafeCell::new((0, 0)),
            fast_allocs: AtomicU64::new(0),
            fast_frees: AtomicU64::new(0),
            orphaned: AtomicBool::new(false),
            orphans,
            stopped,
            pool_id,
            id,
        }
    }

    pub fn id(&self) -> u32 {
        self.id
    }
    pub fn pool_id(&self) -> u64 {
        self.pool_id
    }
    pub fn is_orphaned(&self) -> bool {
        self.orphaned.load(Ordering::Acquire)
    }
    /// Fast-path (allocations, frees) so far.
    pub fn fast_counts(&self) -> (u64, u64) {
        (self.fast_allocs.load(Ordering::Relaxed), self.fast_frees.load(Ordering::Relaxed))
    }

    /// Pool side: `ptr` (of word set `kind`) is being freed or detached through the pool.
    /// Clears HANDED(ptr) (`Some(WordState::Handed)`); another state means the owner freed it
    /// already: the caller reports a double free and changes nothing.
    pub fn claim(&self, kind: WordSet, ptr: usize) -> Option<WordState> {
        match kind {
            WordSet::Ordered => self.ordered.claim(ptr),
            WordSet::Unordered => self.unordered.claim(ptr),
        }
    }

    /// Pool side: empty every kept word (only REUSABLE ones if `reusable_only`); the
    /// caller frees the blocks as their state says.
    pub fn take_kept(&self, reusable_only: bool) -> Vec<(usize, WordState)> {
        let mut out = Vec::new();
        let pick = |h| !reusable_only || h == WordState::Reusable;
        self.ordered.take(pick, &mut out);
        self.unordered.take(pick, &mut out);
        out
    }

    /// Pool side: every block in this cache, with its word set and state.
    pub fn held(&self) -> impl Iterator<Item = (WordSet, usize, WordState)> + '_ {
        let o = self.ordered.held().map(|(p, h)| (WordSet::Ordered, p, h));
        o.chain(self.unordered.held().map(|(p, h)| (WordSet::Unordered, p, h)))
    }

    /// `stream`: the normalised stream handle (`thread_cache::fast_stream`).
    // Inlined into the thread cache's malloc: this is the whole of a cached allocation.
    #[inline]
    pub(crate) fn reuse(&self, kind: WordSet, size: usize, stream: usize) -> Option<usize> {
        if self.stopped.load(Ordering::Relaxed) {
            return None; // the locked path reports why
        }
        let p = match kind {
            WordSet::Ordered => self.ordered.reuse(size, stream),
            WordSet::Unordered => self.unordered.reuse(size, stream),
        }?;
        bump(&self.fast_allocs);
        Some(p)
    }

    pub(crate) fn keep(&self, kind: WordSet, ptr: usize, stream: usize) -> bool {
        let kept = match kind {
            WordSet::Ordered => self.ordered.keep(ptr, REUSABLE, stream).is_some(),
            WordSet::Unordered => {
                // SAFETY: owner thread only.
                let unfenced = unsafe { &mut *self.unfenced.get() };
                if unfenced.1 >= FENCE_BYTES {
                    return false; // enough waiting: this one goes through the pool
                }
                match self.unordered.keep(ptr, UNFENCED, stream) {
                    Some(size) => {
                        unfenced.0 += 1;
                        unfenced.1 += size;
                        true
                    }
                    None => false,
                }
            }
        };
        if kept {
            bump(&self.fast_frees);
        }
        kept
    }

    pub(crate) fn remember(&self, kind: WordSet, ptr: usize, size: usize, stream: usize) {
        match kind {
            WordSet::Ordered => self.ordered.remember(ptr, size, stream),
            WordSet::Unordered => self.unordered.remember(ptr, size, stream),
        }
    }
}


#[cfg(test)]
mod tests {
    use super::*;
    use crate::thread_cache::state::WORDS;

    fn cache() -> ThreadCache {
        ThreadCache::new(1, 0, Arc::new(AtomicUsize::new(0)), Default::default())
    }

    #[test]
    fn keep_reuse_and_claim() {
        let c = cache();
        c.remember(WordSet::Ordered, 0x1000, 100, 1);
        assert!(c.keep(WordSet::Ordered, 0x1000, 1));
        assert!(!c.keep(WordSet::Ordered, 0x1000, 1), "a kept block is not HANDED any more");
        assert_eq!(c.reuse(WordSet::Ordered, 99, 1), None, "sizes must match exactly");
        assert_eq!(c.reuse(WordSet::Ordered, 100, 1), Some(0x1000));
        assert_eq!(c.fast_counts(), (1, 1));
        assert_eq!(c.claim(WordSet::Ordered, 0x1000), Some(WordState::Handed));
        assert!(!c.keep(WordSet::Ordered, 0x1000, 1), "claimed by the pool: the owner takes the locked path");
        c.remember(WordSet::Ordered, 0x2000, 8, 1);
        assert!(c.keep(WordSet::Ordered, 0x2000, 1));
        assert_eq!(c.claim(WordSet::Ordered, 0x2000), Some(WordState::Reusable), "a free of a kept block is a double free");
        assert_eq!(c.take_kept(false), vec![(0x2000, WordState::Reusable)]);
        assert_eq!(c.reuse(WordSet::Ordered, 8, 1), None);
        assert_eq!(c.held().count(), 0);
    }

    #[test]
    fn unordered_frees_wait_for_a_fence() {
        let c = cache();
        c.remember(WordSet::Unordered, 0x4000, 64, 1);
        assert!(!c.keep(WordSet::Ordered, 0x4000, 1), "word sets are separate");
        assert!(c.keep(WordSet::Unordered, 0x4000, 1));
        assert_eq!(c.reuse(WordSet::Unordered, 64, 1), None, "not before a fence");
        assert_eq!(c.claim(WordSet::Unordered, 0x4000), Some(WordState::Unfenced));
        c.unordered.fenced();
        assert_eq!(c.reuse(WordSet::Unordered, 64, 1), Some(0x4000));
    }

    #[test]
    fn remember_replaces_oldest_handed_never_kept() {
        let c = cache();
        for i in 1..=WORDS + 2 {
            c.remember(WordSet::Ordered, i * 0x1000, 1, 1);
        }
        let held: Vec<usize> = c.held().map(|(_, p, _)| p).collect();
        assert_eq!(held.len(), WORDS);
        assert!(!held.contains(&0x1000) && !held.contains(&0x2000), "{held:x?}");
        for &p in &held {
            assert!(c.keep(WordSet::Ordered, p, 1));
        }
        c.remember(WordSet::Ordered, 0x9000, 1, 1);
        assert!(c.held().all(|(_, p, h)| p != 0x9000 && h == WordState::Reusable), "kept blocks are not overwritten");
    }
}

