//! Per-thread fast path for the legacy default stream: a free followed by an allocation of
//! the same size on the same thread skips the device lock, the live-pointer map and the
//! strategy.
//!
//! Why: a cached malloc+free pair costs ~120–200 ns through the locked pool, most of it two
//! uncontended mutex round trips (four atomic read-modify-writes) and the live map. Here a
//! pair is two compare-and-swaps on words this thread owns.
//!
//! How, and why it stays exact:
//! - Each thread has, per device, a `ThreadCache`: a few atomic words for frees that name
//!   the legacy stream (PyTorch, the C API) and a magazine for CuPy's stream-less frees. A
//!   word is EMPTY, HANDED(p) (this thread allocated `p` and may keep it when freed),
//!   REUSABLE(p) (freed by this thread, waiting for its next allocation of the same size) or,
//!   in the magazine, UNFENCED(p) (freed by CuPy, not reusable before a fence, see below).
//! - A kept block stays *live* in the pool's books (its live-map entry names the owning
//!   cache), so the pool never hands it to anyone else; the pool's reports subtract kept
//!   blocks (in use, live count, requested, leaks) and add the fast operations to its
//!   counters, so statistics read as if every free had reached the pool.
//! - Only the owner thread moves a word from HANDED to kept and back; the pool (under its
//!   lock, on any thread) moves words to EMPTY: a free of `p` through the pool (another
//!   thread, another stream) clears HANDED(p), and finding `p` kept there means it was
//!   freed already (a double free, reported like any other). Every transition is a
//!   compare-and-swap, so a race between the owner and the pool has one winner and the loser
//!   falls back to the locked path.
//! - Kept memory is never lost to the pool: the owner's next locked allocation returns its
//!   reusable blocks, an allocation that would otherwise grow takes every thread's reusable
//!   blocks (unfenced ones could not serve it), and reclaim, limits and out-of-memory
//!   escalation take everything. A thread that exits marks its caches
//!   orphaned; the pool empties them on its next locked operation.
//! - Only the legacy default stream takes this path: its handle is the same stream on every
//!   thread, it is never destroyed, and legacy frees need no event at free time. Other
//!   streams (whose handles can be destroyed and recycled, or name a different stream per
//!   thread) always go through the pool.
//! - CuPy's frees name no stream, and the pool's rule for them (`Pool::free_unordered`) is
//!   that a block is reused only after a fence enqueued on the legacy stream after its free.
//!   The magazine keeps that rule: a CuPy free marks the word UNFENCED; once enough are
//!   waiting, the owner's next locked allocation records one fence and makes them all
//!   REUSABLE. One lock and one event record serve `FENCE_BATCH` pairs, as the pool's own
//!   batching does.
//! - Off where every operation must reach the pool: `GPUPOOL_DEBUG`, `GPUPOOL_TRACE`,
//!   `GPUPOOL_POOL=none`, `GPUPOOL_THREAD_CACHE=0`; and under the test-only
//!   `GPUPOOL_UNSAFE_IGNORE_STREAMS`, whose pool must reuse at once to show the stream tests
//!   catch it.

use crate::error::{Error, Result};
use crate::pool::Pool;
use crate::registry::{self, MAX_DEVICES};
use crate::stream::STREAM_LEGACY;
use std::cell::{RefCell, UnsafeCell};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// Blocks one thread can keep eligible for the fast path on one device for legacy-stream
/// frees. Four covers the temporaries of a typical step (allocate a few, free them in any
/// order, repeat).
pub const WORDS: usize = 4;
/// Magazine for CuPy's stream-less frees: room for a fence batch plus blocks in use.
pub const MAGAZINE: usize = 32;
/// Unfenced CuPy frees that make the owner's next locked allocation record a fence.
pub const FENCE_BATCH: usize = 24;
/// ...or this many bytes of them: half the pool's own bound for its unfenced frees, so a
/// thread's magazine and the pool's batch together hold at most 1.5× what the pool alone
/// did before there were thread caches (memory waiting for a fence cannot serve requests).
pub const FENCE_BYTES: usize = crate::pool::UNFENCED_MAX_BYTES / 2;

const EMPTY: usize = 0;
/// Tag bits of kept words (block addresses are at least 256-byte aligned).
const REUSABLE: usize = 1;
const UNFENCED: usize = 2;
const TAGS: usize = REUSABLE | UNFENCED;

/// Which word set a block lives in: frees naming the legacy stream, or CuPy's stream-less
/// frees (the magazine). `Live::owner` records it with the cache id.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Kind {
    Ordered,
    Unordered,
}

/// What a word holds, as the pool sees it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Hold {
    /// Live, allocated by this thread: its free may be kept.
    Handed,
    /// Freed, reusable by the owner's next allocation of its size.
    Reusable,
    /// Freed by CuPy, waiting for a legacy-stream fence before any reuse.
    Unfenced,
}

fn decode(v: usize) -> Option<(usize, Hold)> {
    match (v & !TAGS, v & TAGS) {
        (0, _) => None,
        (p, 0) => Some((p, Hold::Handed)),
        (p, REUSABLE) => Some((p, Hold::Reusable)),
        (p, _) => Some((p, Hold::Unfenced)),
    }
}

/// A set of words shared with the pool, and the owner's private notes on each.
struct Words<const N: usize> {
    /// EMPTY, HANDED(p) = p, REUSABLE(p) = p | REUSABLE, UNFENCED(p) = p | UNFENCED.
    w: [AtomicUsize; N],
    /// Requested size of each word's block (owner only).
    sizes: UnsafeCell<[usize; N]>,
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
    fn new() -> Self {
        Words {
            w: std::array::from_fn(|_| AtomicUsize::new(EMPTY)),
            sizes: UnsafeCell::new([0; N]),
            victim: UnsafeCell::new(0),
            reusable: UnsafeCell::new(0),
            occupied: UnsafeCell::new(0),
            recent: UnsafeCell::new(([0; RECENT], 0)),
        }
    }

    /// Pool side: clear HANDED(ptr). `Some(Hold::Handed)`: cleared; another hold: the
    /// owner freed it already; `None`: not here.
    fn claim(&self, ptr: usize) -> Option<Hold> {
        for w in &self.w {
            let mut cur = w.load(Ordering::Acquire);
            while cur & !TAGS == ptr {
                if cur != ptr {
                    return decode(cur).map(|h| h.1);
                }
                match w.compare_exchange(ptr, EMPTY, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => return Some(Hold::Handed),
                    Err(now) => cur = now, // the owner freed it meanwhile: look again
                }
            }
        }
        None
    }

    /// Empty every kept word whose hold `pick` selects; returns the blocks.
    fn take(&self, pick: impl Fn(Hold) -> bool, out: &mut Vec<(usize, Hold)>) {
        for w in &self.w {
            let cur = w.load(Ordering::Acquire);
            if let Some((p, h)) = decode(cur) {
                if h != Hold::Handed && pick(h) && w.compare_exchange(cur, EMPTY, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                    out.push((p, h));
                }
            }
        }
    }

    fn held(&self) -> impl Iterator<Item = (usize, Hold)> + '_ {
        self.w.iter().filter_map(|w| decode(w.load(Ordering::Acquire)))
    }

    /// Owner: a REUSABLE block of exactly `size` requested bytes, now HANDED again.
    fn reuse(&self, size: usize) -> Option<usize> {
        // SAFETY: owner thread only (see the `Sync` impl of `ThreadCache`).
        let (sizes, reusable) = unsafe { (&*self.sizes.get(), &mut *self.reusable.get()) };
        if *reusable == 0 {
            return None;
        }
        let mut seen = 0;
        for (w, &s) in self.w.iter().zip(sizes) {
            let cur = w.load(Ordering::Relaxed);
            if cur & TAGS == REUSABLE {
                seen += 1;
                if s == size && w.compare_exchange(cur, cur & !TAGS, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
                    *reusable -= 1;
                    return Some(cur & !TAGS);
                }
            }
        }
        *reusable = seen;
        None
    }

    /// Owner: take back every REUSABLE word (for the pool to free).
    fn take_reusable(&self, out: &mut Vec<(usize, Hold)>) {
        // SAFETY: owner thread only.
        let reusable = unsafe { &mut *self.reusable.get() };
        if *reusable != 0 {
            self.take(|h| h == Hold::Reusable, out);
            *reusable = 0;
        }
    }

    /// Owner: take back the UNFENCED words whose requested size is not `size`; returns
    /// their count and bytes.
    fn take_unfenced_other_than(&self, size: usize, out: &mut Vec<(usize, Hold)>) -> (usize, usize) {
        // SAFETY: owner thread only.
        let sizes = unsafe { &*self.sizes.get() };
        let mut taken = (0, 0);
        for (w, &s) in self.w.iter().zip(sizes) {
            let cur = w.load(Ordering::Relaxed);
            if cur & TAGS == UNFENCED && s != size && w.compare_exchange(cur, EMPTY, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
                out.push((cur & !TAGS, Hold::Unfenced));
                taken = (taken.0 + 1, taken.1 + s);
            }
        }
        taken
    }

    /// Owner, before a locked allocation of `size`: whether this size was asked for among
    /// the last `RECENT` locked allocations (then the block is worth remembering).
    fn repeats(&self, size: usize) -> bool {
        // SAFETY: owner thread only.
        let (sizes, next) = unsafe { &mut *self.recent.get() };
        let seen = sizes.contains(&size);
        sizes[*next] = size;
        *next = (*next + 1) % RECENT;
        seen
    }

    /// Owner: keep `ptr` (tagged `tag`) if this thread holds it HANDED; its size.
    fn keep(&self, ptr: usize, tag: usize) -> Option<usize> {
        // SAFETY: owner thread only.
        let occupied = unsafe { &mut *self.occupied.get() };
        if *occupied == 0 {
            return None;
        }
        let mut seen = 0;
        for (i, w) in self.w.iter().enumerate() {
            let cur = w.load(Ordering::Relaxed);
            if cur == ptr {
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
    fn fenced(&self) {
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
    fn remember(&self, ptr: usize, size: usize) {
        // SAFETY: owner thread only.
        let (sizes, victim, occupied) = unsafe { (&mut *self.sizes.get(), &mut *self.victim.get(), &mut *self.occupied.get()) };
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
        // A plain store is enough: the pool only ever clears HANDED words, so whether its
        // claim of the old block lands before or after, the old block simply loses the
        // fast path (a word the pool just emptied is free to take).
        self.w[i].store(ptr, Ordering::Release);
    }
}

/// One thread's fast-path state for one device's pool.
pub struct ThreadCache {
    ordered: Words<WORDS>,
    unordered: Words<MAGAZINE>,
    /// Owner only: count and bytes of UNFENCED words (an upper bound: the pool may have
    /// emptied some since).
    unfenced: UnsafeCell<(usize, usize)>,
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
    pub fn new(pool_id: u64, id: u32, orphans: Arc<AtomicUsize>) -> Self {
        ThreadCache {
            ordered: Words::new(),
            unordered: Words::new(),
            unfenced: UnsafeCell::new((0, 0)),
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

    /// Pool side: `ptr` (of word set `kind`) is being freed or detached through the pool.
    /// Clears HANDED(ptr) (`Some(Hold::Handed)`); another hold means the owner freed it
    /// already: the caller reports a double free and changes nothing.
    pub fn claim(&self, kind: Kind, ptr: usize) -> Option<Hold> {
        match kind {
            Kind::Ordered => self.ordered.claim(ptr),
            Kind::Unordered => self.unordered.claim(ptr),
        }
    }

    /// Pool side: empty every kept word (only REUSABLE ones if `reusable_only`); the
    /// caller frees the blocks as their hold says.
    pub fn take_kept(&self, reusable_only: bool) -> Vec<(usize, Hold)> {
        let mut out = Vec::new();
        let pick = |h| !reusable_only || h == Hold::Reusable;
        self.ordered.take(pick, &mut out);
        self.unordered.take(pick, &mut out);
        out
    }

    /// Pool side: every block in this cache, with its word set and hold.
    pub fn held(&self) -> impl Iterator<Item = (Kind, usize, Hold)> + '_ {
        let o = self.ordered.held().map(|(p, h)| (Kind::Ordered, p, h));
        o.chain(self.unordered.held().map(|(p, h)| (Kind::Unordered, p, h)))
    }

    fn reuse(&self, kind: Kind, size: usize) -> Option<usize> {
        let p = match kind {
            Kind::Ordered => self.ordered.reuse(size),
            Kind::Unordered => self.unordered.reuse(size),
        }?;
        bump(&self.fast_allocs);
        Some(p)
    }

    fn keep(&self, kind: Kind, ptr: usize) -> bool {
        let kept = match kind {
            Kind::Ordered => self.ordered.keep(ptr, REUSABLE).is_some(),
            Kind::Unordered => {
                // SAFETY: owner thread only.
                let unfenced = unsafe { &mut *self.unfenced.get() };
                if unfenced.1 >= FENCE_BYTES {
                    return false; // enough waiting: this one goes through the pool
                }
                match self.unordered.keep(ptr, UNFENCED) {
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

    fn remember(&self, kind: Kind, ptr: usize, size: usize) {
        match kind {
            Kind::Ordered => self.ordered.remember(ptr, size),
            Kind::Unordered => self.unordered.remember(ptr, size),
        }
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

/// The locked part of an allocation, on the owner thread under the device lock: attach
/// this thread's cache (making one if needed: `fresh`), let the magazine fence and reuse,
/// else allocate from the pool and remember the block.
fn locked_malloc(
    pool: &mut Pool,
    kind: Kind,
    size: usize,
    stream: usize,
    mine: Option<&ThreadCache>,
) -> (Result<usize>, Option<Arc<ThreadCache>>) {
    let current = mine.map(|c| (c.pool_id, c.id));
    let Some((id, fresh)) = pool.attach_thread(current, stream) else {
        return (pool.malloc(size, stream), None);
    };
    let cache = match (&fresh, mine) {
        (Some(f), _) => &**f,
        (None, Some(m)) => m,
        // attach_thread keeps a cache only for a thread that has one; never here.
        (None, None) => return (pool.malloc(size, stream), None),
    };
    // This thread's reusable legacy-stream blocks go back first, so this request may use
    // their memory (a thread whose sizes repeat does not get here).
    let mut back = Vec::new();
    cache.ordered.take_reusable(&mut back);
    for (p, hold) in back {
        pool.release_kept(p, hold);
    }
    if kind == Kind::Unordered && size != 0 {
        // SAFETY: the owner thread (we run inside its allocation call).
        let unfenced = unsafe { &mut *cache.unfenced.get() };
        if unfenced.0 >= FENCE_BATCH || unfenced.1 >= FENCE_BYTES {
            pool.fence_legacy_now();
            cache.unordered.fenced();
            *unfenced = (0, 0);
        }
        if let Some(p) = cache.reuse(kind, size) {
            return (Ok(p), fresh);
        }
        // A miss. The fenced blocks of other sizes go back, so this request may use them;
        // so do unfenced ones of other sizes, into the pool's own batch: the magazine holds
        // frees only while the thread keeps asking for their sizes. (A thread whose sizes
        // never repeat thus hands the pool each free at its next allocation, which makes the
        // same decisions as without the cache.)
        let mut back = Vec::new();
        cache.unordered.take_reusable(&mut back);
        if unfenced.0 != 0 {
            let (n, bytes) = cache.unordered.take_unfenced_other_than(size, &mut back);
            *unfenced = (unfenced.0.saturating_sub(n), unfenced.1.saturating_sub(bytes));
        }
        for (p, hold) in back {
            pool.release_kept(p, hold);
        }
    }
    let words_repeat = match kind {
        Kind::Ordered => cache.ordered.repeats(size),
        Kind::Unordered => cache.unordered.repeats(size),
    };
    if !words_repeat || size == 0 {
        return (pool.malloc(size, stream), fresh);
    }
    let r = pool.malloc_owned(size, stream, crate::pool::owner_of(id, kind));
    if let Ok(p) = r {
        cache.remember(kind, p, size);
    }
    (r, fresh)
}

fn malloc_kind(device: i32, size: usize, stream: usize, kind: Kind) -> Result<usize> {
    let locked = |mine: Option<&ThreadCache>| registry::with_pool(device, |pool| Ok(locked_malloc(pool, kind, size, stream, mine)));
    if device < 0 || device as usize >= MAX_DEVICES {
        return locked(None).and_then(|r| r.0);
    }
    let d = device as usize;
    let mut locked = Some(locked);
    let in_tls = MINE.try_with(|m| {
        let v = m.0.borrow();
        let mine = v.get(d).and_then(|c| c.as_deref());
        if size != 0 {
            if let Some(p) = mine.and_then(|c| c.reuse(kind, size)) {
                return Ok(p);
            }
        }
        // The pool never touches this thread-local, so the shared borrow may span the call.
        let (r, fresh) = (locked.take().expect("called once"))(mine)?;
        if let Some(fresh) = fresh {
            drop(v);
            let mut v = m.0.borrow_mut();
            if v.len() <= d {
                v.resize(d + 1, None);
            }
            v[d] = Some(fresh);
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

/// Allocate `size` bytes on `device` for `stream`: a block this thread kept, else the pool.
pub fn malloc(device: i32, size: usize, stream: usize) -> Result<usize> {
    if !crate::stream::is_legacy(stream) {
        return registry::with_pool(device, |pool| pool.malloc(size, stream));
    }
    malloc_kind(device, size, stream, Kind::Ordered)
}

/// Allocate for a caller that names no stream (CuPy): a fenced block this thread kept,
/// else the pool.
pub fn malloc_unordered(device: i32, size: usize) -> Result<usize> {
    malloc_kind(device, size, STREAM_LEGACY, Kind::Unordered)
}

/// Fast free on the legacy stream: keep `ptr` if this thread allocated it there and still
/// holds it. `false`: the caller frees through the pool.
pub fn try_free(device: i32, ptr: usize, stream: usize) -> bool {
    crate::stream::is_legacy(stream) && with_mine(device, |c| c.keep(Kind::Ordered, ptr).then_some(())).is_some()
}

/// Fast stream-less free (CuPy): keep `ptr` as UNFENCED if this thread allocated it so.
pub fn try_free_unordered(device: i32, ptr: usize) -> bool {
    with_mine(device, |c| c.keep(Kind::Unordered, ptr).then_some(())).is_some()
}

/// A block this thread kept on `device` for `size` bytes, handed out again (tests).
pub fn try_malloc(device: i32, size: usize, stream: usize) -> Option<usize> {
    if !crate::stream::is_legacy(stream) {
        return None;
    }
    with_mine(device, |c| c.reuse(Kind::Ordered, size))
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
    fn keep_reuse_and_claim() {
        let c = cache();
        c.remember(Kind::Ordered, 0x1000, 100);
        assert!(c.keep(Kind::Ordered, 0x1000));
        assert!(!c.keep(Kind::Ordered, 0x1000), "a kept block is not HANDED any more");
        assert_eq!(c.reuse(Kind::Ordered, 99), None, "sizes must match exactly");
        assert_eq!(c.reuse(Kind::Ordered, 100), Some(0x1000));
        assert_eq!(c.fast_counts(), (1, 1));
        assert_eq!(c.claim(Kind::Ordered, 0x1000), Some(Hold::Handed));
        assert!(!c.keep(Kind::Ordered, 0x1000), "claimed by the pool: the owner takes the locked path");
        c.remember(Kind::Ordered, 0x2000, 8);
        assert!(c.keep(Kind::Ordered, 0x2000));
        assert_eq!(c.claim(Kind::Ordered, 0x2000), Some(Hold::Reusable), "a free of a kept block is a double free");
        assert_eq!(c.take_kept(false), vec![(0x2000, Hold::Reusable)]);
        assert_eq!(c.reuse(Kind::Ordered, 8), None);
        assert_eq!(c.held().count(), 0);
    }

    #[test]
    fn unordered_frees_wait_for_a_fence() {
        let c = cache();
        c.remember(Kind::Unordered, 0x4000, 64);
        assert!(!c.keep(Kind::Ordered, 0x4000), "word sets are separate");
        assert!(c.keep(Kind::Unordered, 0x4000));
        assert_eq!(c.reuse(Kind::Unordered, 64), None, "not before a fence");
        assert_eq!(c.claim(Kind::Unordered, 0x4000), Some(Hold::Unfenced));
        c.unordered.fenced();
        assert_eq!(c.reuse(Kind::Unordered, 64), Some(0x4000));
    }

    #[test]
    fn remember_replaces_oldest_handed_never_kept() {
        let c = cache();
        for i in 1..=WORDS + 2 {
            c.remember(Kind::Ordered, i * 0x1000, 1);
        }
        let held: Vec<usize> = c.held().map(|(_, p, _)| p).collect();
        assert_eq!(held.len(), WORDS);
        assert!(!held.contains(&0x1000) && !held.contains(&0x2000), "{held:x?}");
        for &p in &held {
            assert!(c.keep(Kind::Ordered, p));
        }
        c.remember(Kind::Ordered, 0x9000, 1);
        assert!(c.held().all(|(_, p, h)| p != 0x9000 && h == Hold::Reusable), "kept blocks are not overwritten");
    }
}
