//! Per-thread fast path for the legacy default stream: a free followed by an allocation of
//! the same size on the same thread skips the device lock, the live-pointer map and the
//! strategy.
//!
//! Why: a cached malloc+free pair costs ~120–150 ns through the locked pool, most of it two
//! uncontended mutex round trips (four atomic read-modify-writes) and the live map. Here a
//! pair is two compare-and-swaps on a word this thread owns.
//!
//! How, and why it stays exact:
//! - Each thread has, per device, a `ThreadCache` of `WORDS` atomic words. A word is EMPTY,
//!   HANDED(p) (this thread allocated `p` and may park it) or PARKED(p) (`p` was freed by
//!   this thread and waits here for its next allocation of the same size).
//! - A parked block stays *live* in the pool's books (its live-map entry remembers the
//!   owning cache), so the pool never hands it to anyone else; the pool's reports subtract
//!   parked blocks (in use, live count, requested, leaks) and add the fast operations to its
//!   counters, so statistics read as if every free had reached the pool.
//! - Only the owner thread moves a word HANDED → PARKED → HANDED; the pool (under its lock,
//!   on any thread) moves words to EMPTY: a free of `p` through the pool (another thread, a
//!   stream other than the legacy one) clears HANDED(p), and finding PARKED(p) there means
//!   `p` was already freed (double free, reported like any other). Every transition is a
//!   compare-and-swap, so a race between the owner and the pool has one winner and the loser
//!   falls back to the locked path.
//! - Parked memory is never lost to the pool: the owner's next locked allocation flushes its
//!   parked blocks first, an allocation that would otherwise grow flushes every thread's,
//!   and so do reclaim, limits and out-of-memory escalation. A thread that exits marks its
//!   caches orphaned; the pool flushes them on its next locked operation.
//! - Only the legacy default stream takes this path: its handle is the same stream on every
//!   thread, it is never destroyed, and legacy frees need no event at free time. Other
//!   streams (whose handles can be destroyed and recycled, or name a different stream per
//!   thread) always go through the pool.
//! - Off where every operation must reach the pool: `GPUPOOL_DEBUG`, `GPUPOOL_TRACE`,
//!   `GPUPOOL_POOL=none`, `GPUPOOL_THREAD_CACHE=0`.

use crate::error::{Error, Result};
use crate::registry::MAX_DEVICES;
use std::cell::{RefCell, UnsafeCell};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// Blocks one thread can have eligible for the fast path on one device. Four covers the
/// temporaries of a typical step (allocate a few, free them in any order, repeat).
pub const WORDS: usize = 4;
const EMPTY: usize = 0;
/// Tag bit of a parked word (block addresses are at least 256-byte aligned).
const PARKED: usize = 1;

/// What a word holds, as the pool sees it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Hold {
    Handed,
    Parked,
}

/// One thread's fast-path state for one device's pool.
pub struct ThreadCache {
    /// EMPTY, HANDED(p) = p, or PARKED(p) = p | PARKED.
    words: [AtomicUsize; WORDS],
    /// Requested size of each word's block: written and read by the owner thread only.
    sizes: UnsafeCell<[usize; WORDS]>,
    /// Next word to overwrite when all hold blocks (owner only).
    victim: UnsafeCell<usize>,
    /// Fast-path allocations and frees (written by the owner, read by the pool's reports).
    fast_allocs: AtomicU64,
    fast_frees: AtomicU64,
    /// Set when the owner thread has exited.
    orphaned: AtomicBool,
    /// The pool's count of orphaned caches, bumped on exit so the pool notices cheaply.
    orphans: Arc<AtomicUsize>,
    /// Identity of the pool this cache belongs to, and its index there.
    pool_id: u64,
    id: u32,
}

// SAFETY: `sizes` and `victim` are touched only by the owner thread (the thread whose TLS
// holds the cache; the pool never reads them); everything else is atomic or immutable.
unsafe impl Sync for ThreadCache {}
unsafe impl Send for ThreadCache {}

impl ThreadCache {
    pub fn new(pool_id: u64, id: u32, orphans: Arc<AtomicUsize>) -> Self {
        ThreadCache {
            words: Default::default(),
            sizes: UnsafeCell::new([0; WORDS]),
            victim: UnsafeCell::new(0),
            fast_allocs: AtomicU64::new(0),
            fast_frees: AtomicU64::new(0),
            orphaned: AtomicBool::new(false),
            orphans,
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

    /// Pool side: `ptr` is being freed or detached through the pool. Clears HANDED(ptr);
    /// returns `Some(Hold::Parked)` when the owner already freed it (the caller reports a
    /// double free and changes nothing), `Some(Hold::Handed)` when a word was cleared.
    pub fn claim(&self, ptr: usize) -> Option<Hold> {
        for w in &self.words {
            let mut cur = w.load(Ordering::Acquire);
            loop {
                if cur == ptr {
                    match w.compare_exchange(ptr, EMPTY, Ordering::AcqRel, Ordering::Acquire) {
                        Ok(_) => return Some(Hold::Handed),
                        Err(now) => cur = now, // the owner parked it meanwhile: look again
                    }
                } else if cur == ptr | PARKED {
                    return Some(Hold::Parked);
                } else {
                    break;
                }
            }
        }
        None
    }

    /// Pool side: empty every PARKED word and return the blocks, which the caller frees.
    pub fn take_parked(&self) -> Vec<usize> {
        let mut out = Vec::new();
        for w in &self.words {
            let cur = w.load(Ordering::Acquire);
            if cur & PARKED != 0 && w.compare_exchange(cur, EMPTY, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                out.push(cur & !PARKED);
            }
        }
        out
    }

    /// Pool side: the blocks in this cache, with how each is held (reports, invariants).
    pub fn held(&self) -> impl Iterator<Item = (usize, Hold)> + '_ {
        self.words.iter().filter_map(|w| match w.load(Ordering::Acquire) {
            EMPTY => None,
            v if v & PARKED != 0 => Some((v & !PARKED, Hold::Parked)),
            v => Some((v, Hold::Handed)),
        })
    }

    /// Owner: a parked block of exactly `size` requested bytes, now HANDED again.
    fn reuse(&self, size: usize) -> Option<usize> {
        // SAFETY: owner thread only (see the `Sync` impl).
        let sizes = unsafe { &*self.sizes.get() };
        for (w, &s) in self.words.iter().zip(sizes) {
            let cur = w.load(Ordering::Relaxed);
            if cur & PARKED != 0
                && s == size
                && w.compare_exchange(cur, cur & !PARKED, Ordering::AcqRel, Ordering::Relaxed).is_ok()
            {
                self.fast_allocs.store(self.fast_allocs.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
                return Some(cur & !PARKED);
            }
        }
        None
    }

    /// Owner: park `ptr` if this thread holds it HANDED.
    fn park(&self, ptr: usize) -> bool {
        for w in &self.words {
            if w.load(Ordering::Relaxed) == ptr {
                if w.compare_exchange(ptr, ptr | PARKED, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
                    self.fast_frees.store(self.fast_frees.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
                    return true;
                }
                return false; // the pool claimed it meanwhile
            }
        }
        false
    }

    /// Owner, after a locked allocation (which flushed this cache's parked blocks): make
    /// `ptr` eligible for the fast path, replacing an empty word or else the oldest HANDED.
    fn remember(&self, ptr: usize, size: usize) {
        // SAFETY: owner thread only.
        let (sizes, victim) = unsafe { (&mut *self.sizes.get(), &mut *self.victim.get()) };
        let i = match self.words.iter().position(|w| w.load(Ordering::Relaxed) == EMPTY) {
            Some(i) => i,
            None => {
                let i = *victim;
                *victim = (i + 1) % WORDS;
                // Only this thread parks, and it parked nothing since the flush.
                debug_assert_eq!(self.words[i].load(Ordering::Relaxed) & PARKED, 0);
                i
            }
        };
        sizes[i] = size;
        // A plain store is enough: the pool only ever clears HANDED words, so whether its
        // claim of the old block lands before or after, the old block simply loses the fast path.
        self.words[i].store(ptr, Ordering::Release);
    }
}

/// This thread's caches, by device. On thread exit each is marked orphaned.
struct Mine(RefCell<Vec<Option<Arc<ThreadCache>>>>);

impl Drop for Mine {
    fn drop(&mut self) {
        for c in self.0.borrow().iter().flatten() {
            c.orphaned.store(true, Ordering::Release);
            c.orphans.fetch_add(1, Ordering::AcqRel);
        }
    }
}

thread_local! {
    static MINE: Mine = const { Mine(RefCell::new(Vec::new())) };
}

fn with_mine<R>(device: i32, f: impl FnOnce(&ThreadCache) -> Option<R>) -> Option<R> {
    if device < 0 || device as usize >= MAX_DEVICES {
        return None;
    }
    // `try_with`: during thread teardown the TLS may be gone; the locked path still works.
    MINE.try_with(|m| m.0.borrow().get(device as usize).and_then(|c| c.as_deref()).and_then(f)).ok().flatten()
}

/// What the locked allocation reports back: the cache id it recorded the block for, and a
/// new cache for this thread to install, if it made one (`Pool::attach_thread`).
pub type Attached = Option<(u32, Option<Arc<ThreadCache>>)>;

/// Allocate on `device`: a block this thread parked for exactly `size` bytes on the legacy
/// stream if there is one, else `locked(current)` (the pool under its lock; `current` is
/// this thread's (pool id, cache id)), after which the new block is remembered for the
/// fast free. One thread-local lookup either way.
pub fn malloc_with(
    device: i32,
    size: usize,
    stream: usize,
    locked: impl FnOnce(Option<(u64, u32)>) -> Result<(Result<usize>, Attached)>,
) -> Result<usize> {
    let legacy = crate::stream::is_legacy(stream) && size != 0;
    if device < 0 || device as usize >= MAX_DEVICES {
        return locked(None).and_then(|r| r.0);
    }
    let d = device as usize;
    let mut locked = Some(locked);
    let in_tls = MINE.try_with(|m| {
        let v = m.0.borrow();
        let cache = v.get(d).and_then(|c| c.as_deref());
        if legacy {
            if let Some(p) = cache.and_then(|c| c.reuse(size)) {
                return Ok(p);
            }
        }
        // The pool never touches this thread-local, so the shared borrow may span the call.
        let (r, attached) = (locked.take().expect("called once"))(cache.map(|c| (c.pool_id, c.id)))?;
        if let (Ok(p), Some((id, fresh))) = (&r, attached) {
            match fresh {
                None => {
                    if let Some(c) = cache.filter(|c| c.id == id && legacy) {
                        c.remember(*p, size);
                    }
                }
                Some(fresh) => {
                    if legacy {
                        fresh.remember(*p, size);
                    }
                    drop(v);
                    let mut v = m.0.borrow_mut();
                    if v.len() <= d {
                        v.resize(d + 1, None);
                    }
                    v[d] = Some(fresh);
                }
            }
        }
        r
    });
    match in_tls {
        Ok(r) => r,
        // Thread teardown: the thread-local is gone; the pool alone serves.
        Err(_) => match locked.take() {
            Some(f) => f(None).and_then(|r| r.0),
            None => Err(Error::Internal("thread cache: allocation interrupted by thread exit".into())),
        },
    }
}

/// Fast free: park `ptr` if this thread allocated it on `device` and still holds it.
pub fn try_free(device: i32, ptr: usize, stream: usize) -> bool {
    if !crate::stream::is_legacy(stream) {
        return false;
    }
    with_mine(device, |c| c.park(ptr).then_some(())).is_some()
}

/// A block this thread parked on `device` for `size` bytes, now handed out again (tests).
pub fn try_malloc(device: i32, size: usize, stream: usize) -> Option<usize> {
    if !crate::stream::is_legacy(stream) {
        return None;
    }
    with_mine(device, |c| c.reuse(size))
}

/// The (pool id, cache id) of this thread's cache for `device`, if it has one.
pub fn current(device: i32) -> Option<(u64, u32)> {
    with_mine(device, |c| Some((c.pool_id, c.id)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache() -> ThreadCache {
        ThreadCache::new(1, 0, Arc::new(AtomicUsize::new(0)))
    }

    #[test]
    fn park_reuse_and_claim() {
        let c = cache();
        c.remember(0x1000, 100);
        assert!(c.park(0x1000));
        assert!(!c.park(0x1000), "a parked block is not HANDED any more");
        assert_eq!(c.reuse(99), None, "sizes must match exactly");
        assert_eq!(c.reuse(100), Some(0x1000));
        assert_eq!(c.fast_counts(), (1, 1));
        assert_eq!(c.claim(0x1000), Some(Hold::Handed));
        assert!(!c.park(0x1000), "claimed by the pool: the owner takes the locked path");
        c.remember(0x2000, 8);
        assert!(c.park(0x2000));
        assert_eq!(c.claim(0x2000), Some(Hold::Parked), "a free of a parked block is a double free");
        assert_eq!(c.take_parked(), vec![0x2000]);
        assert_eq!(c.reuse(8), None);
        assert_eq!(c.held().count(), 0);
    }

    #[test]
    fn remember_replaces_oldest_handed_when_full() {
        let c = cache();
        for i in 1..=WORDS + 2 {
            c.remember(i * 0x1000, 1);
        }
        let held: Vec<usize> = c.held().map(|(p, _)| p).collect();
        assert_eq!(held.len(), WORDS);
        assert!(!held.contains(&0x1000) && !held.contains(&0x2000), "{held:x?}");
    }
}
