//! The pool's side of the per-thread fast path (`crate::thread_cache`): which threads'
//! caches are attached to this pool (`AttachedCaches`), and the pool's operations on them:
//! attaching a thread, taking kept blocks back, and the figures reports subtract.
//!
//! Everything here runs under the device lock. The caches' words are shared with their
//! owner threads, which change them without the lock, so every read here is a snapshot and
//! every change a compare-and-swap (see `crate::thread_cache` for the protocol).

use super::{FreeOn, Pool, PoolOptions};
use crate::config::PoolKind;
use crate::stream::StreamHandle;
mod cache;
mod words;

pub use cache::{WordSet, ThreadCache};
pub use words::Hold;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// `Live::owner` of a block no thread cache may hold.
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
pub const FENCE_BYTES: usize = super::UNFENCED_MAX_BYTES / 2;

pub const NO_OWNER: u32 = u32::MAX;
/// `Live::owner` bit: the block lives in the cache's magazine (CuPy's stream-less frees).
const UNORDERED_BIT: u32 = 1 << 31;

/// The `Live::owner` value for cache `id`'s word set `kind`.
pub fn owner_of(id: u32, kind: WordSet) -> u32 {
    match kind {
        WordSet::Ordered => id,
        WordSet::Unordered => id | UNORDERED_BIT,
    }
}

fn split_owner(owner: u32) -> (u32, WordSet) {
    if owner & UNORDERED_BIT != 0 {
        (owner & !UNORDERED_BIT, WordSet::Unordered)
    } else {
        (owner, WordSet::Ordered)
    }
}

/// Pools get distinct ids, so a thread's cache from a pool that was since replaced
/// (`gpupool_configure`) is recognised as stale.
static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

/// The thread caches attached to one pool, by id (module docs).
pub struct AttachedCaches {
    enabled: bool,
    pool_id: u64,
    /// Caches by id; `None` = a free id.
    caches: Vec<Option<Arc<ThreadCache>>>,
    free_ids: Vec<u32>,
    /// Bumped by each exiting owner thread (`thread_cache::Mine::drop`).
    orphans: Arc<AtomicUsize>,
    /// Fast-path (allocations, frees) of caches already dropped.
    retired: (u64, u64),
    /// Shared with every cache: the pool stopped (`Pool::stop`).
    stopped: Arc<std::sync::atomic::AtomicBool>,
}

impl AttachedCaches {
    /// The caches of device `device`'s pool built with `opts`: enabled where `opts` asks
    /// for them and nothing needs every operation to reach the pool.
    pub fn new(opts: &PoolOptions, device: i32) -> Self {
        // Off where every operation must reach the pool, and in the unsafe test mode (whose
        // point is a pool that reuses at once, the way the cache never does).
        let enabled = opts.thread_cache
            && opts.debug == 0
            && opts.tracer.is_none()
            && opts.kind != PoolKind::None
            && !opts.unsafe_ignore_streams
            && device >= 0;
        AttachedCaches {
            enabled,
            pool_id: NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed),
            caches: Vec::new(),
            free_ids: Vec::new(),
            orphans: Arc::new(AtomicUsize::new(0)),
            retired: (0, 0),
            stopped: Default::default(),
        }
    }

    /// The pool stopped: no cache hands out a kept block again, none is attached.
    pub fn disable(&mut self) {
        self.enabled = false;
        self.stopped.store(true, Ordering::Release);
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// The cache of a thread that has `current` (pool id, cache id) for this device, or a
    /// new one (returned second, for the thread to install). `None` when disabled.
    pub fn attach(&mut self, current: Option<(u64, u32)>) -> Option<(u32, Option<Arc<ThreadCache>>)> {
        if !self.enabled {
            return None;
        }
        if let Some((pool_id, id)) = current {
            if pool_id == self.pool_id && self.get(id).is_some_and(|c| !c.is_orphaned()) {
                return Some((id, None));
            }
        }
        let id = self.free_ids.pop().unwrap_or(self.caches.len() as u32);
        let cache = Arc::new(ThreadCache::new(self.pool_id, id, self.orphans.clone(), self.stopped.clone()));
        if id as usize == self.caches.len() {
            self.caches.push(Some(cache.clone()));
        } else {
            self.caches[id as usize] = Some(cache.clone());
        }
        Some((id, Some(cache)))
    }

    pub fn count(&self) -> usize {
        self.all().count()
    }

    fn get(&self, id: u32) -> Option<&ThreadCache> {
        self.caches.get(id as usize).and_then(|c| c.as_deref())
    }

    /// Clear HANDED(`ptr`) in the cache named by `owner` (a `Live::owner`). `Some(hold)`
    /// other than `Handed`: its thread freed it already (a double free).
    pub fn claim(&self, owner: u32, ptr: usize) -> Option<Hold> {
        let (id, kind) = split_owner(owner);
        self.get(id).and_then(|c| c.claim(kind, ptr))
    }

    /// Whether `ptr` is kept (freed) in the cache named by `owner`.
    pub fn is_kept(&self, owner: u32, ptr: usize) -> bool {
        let (id, _) = split_owner(owner);
        self.get(id).is_some_and(|c| c.held().any(|(_, p, h)| p == ptr && h != Hold::Handed))
    }

    fn all(&self) -> impl Iterator<Item = &ThreadCache> {
        self.caches.iter().flatten().map(|c| &**c)
    }

    /// Whether any thread keeps freed blocks that are reusable now (a few atomic loads per
    /// thread).
    pub fn any_reusable(&self) -> bool {
        self.all().any(|c| c.held().any(|(_, _, h)| h == Hold::Reusable))
    }

    /// Every kept (freed) block (reports; the snapshot may be a moment old).
    pub fn kept(&self) -> Vec<usize> {
        self.all().flat_map(|c| c.held().filter(|(_, _, h)| *h != Hold::Handed).map(|(_, p, _)| p)).collect()
    }

    /// Every block held by any cache, with its `Live::owner` value (invariant scan).
    pub fn held(&self) -> Vec<(u32, usize, Hold)> {
        self.all().flat_map(|c| c.held().map(move |(k, p, h)| (owner_of(c.id(), k), p, h))).collect()
    }

    /// Empty every cache's kept words (only the REUSABLE ones if `reusable_only`); the
    /// caller frees the blocks as their hold says.
    pub fn take_all_kept(&self, reusable_only: bool) -> Vec<(usize, Hold)> {
        self.all().flat_map(|c| c.take_kept(reusable_only)).collect()
    }

    /// Whether some owner thread has exited (one atomic load).
    pub fn has_orphans(&self) -> bool {
        self.orphans.load(Ordering::Acquire) != 0
    }

    /// Drop the caches of exited threads; returns their kept blocks for the caller to free.
    pub fn reap(&mut self) -> Vec<(usize, Hold)> {
        if !self.has_orphans() {
            return Vec::new();
        }
        let mut out = Vec::new();
        for id in 0..self.caches.len() {
            let Some(c) = self.caches[id].as_ref() else { continue };
            if !c.is_orphaned() {
                continue;
            }
            out.extend(c.take_kept(false));
            let (a, f) = c.fast_counts();
            self.retired.0 += a;
            self.retired.1 += f;
            self.caches[id] = None;
            self.free_ids.push(id as u32);
            self.orphans.fetch_sub(1, Ordering::AcqRel);
        }
        out
    }

    /// Fast-path (allocations, frees) of every cache, past and present.
    pub fn fast_counts(&self) -> (u64, u64) {
        self.all().map(ThreadCache::fast_counts).fold(self.retired, |a, b| (a.0 + b.0, a.1 + b.1))
    }
}

/// The pool's operations on its thread caches, under the device lock.
impl Pool {
    /// The calling thread's fast-path cache for a locked allocation on `stream`: `current`
    /// is the (pool id, cache id) the thread already has for this device. Exited threads'
    /// caches are emptied first. Returns the cache id to pass to `malloc_owned` (with
    /// `owner_of`), and a new cache for the thread to install, if one was made. `None`: no
    /// fast path here (disabled, or the per-thread default stream).
    pub fn attach_thread(&mut self, current: Option<(u64, u32)>, stream: StreamHandle) -> Option<(u32, Option<Arc<ThreadCache>>)> {
        if !self.caches.enabled() || stream == crate::stream::STREAM_PER_THREAD {
            return None; // (the per-thread default stream means another stream on each thread)
        }
        if self.caches.has_orphans() {
            for (p, hold) in self.caches.reap() {
                self.release_kept(p, hold, Some(stream));
            }
        }
        self.caches.attach(current)
    }

    /// Thread caches registered with this pool (exited threads' until the next locked
    /// operation reaps them).
    pub fn thread_cache_count(&self) -> usize {
        self.caches.count()
    }

    /// Blocks freed by their users and kept in thread caches (tests, reports).
    pub fn kept_blocks(&self) -> usize {
        self.caches.kept().len()
    }

    /// Give every block kept in a thread cache back to the pool (reclaim, limits, growth,
    /// reconfiguration). `current`: the stream of the operation in progress, if any (its
    /// kept blocks record their free there; the others' streams may be gone).
    pub fn flush_thread_caches(&mut self, current: Option<StreamHandle>) {
        let mut kept = self.caches.reap();
        kept.extend(self.caches.take_all_kept(false));
        for (p, hold) in kept {
            self.release_kept(p, hold, current);
        }
    }

    /// Free a block taken out of a thread cache: its user freed it already (counted then).
    /// A CuPy free not yet fenced joins the pool's unfenced frees. `current`: the stream of
    /// the operation in progress (alive now), if any.
    pub fn release_kept(&mut self, ptr: usize, hold: Hold, current: Option<StreamHandle>) {
        let counted = self.rec.c.frees;
        let _ = match hold {
            Hold::Unfenced => self.free(ptr, FreeOn::Unordered),
            // Kept only when freed on its allocation stream: free it there, recording only
            // if that stream is known alive (its user may have destroyed it since the free).
            _ => match self.core.live(ptr).map(|l| (l.handle, l.block.stream)) {
                Some((h, key)) => self.free_later(ptr, h, key, false, current),
                None => self.free(ptr, FreeOn::Stream(crate::stream::STREAM_LEGACY)),
            },
        };
        self.rec.c.frees = counted;
    }

    /// Count, bytes and requested bytes of the blocks kept (freed) in thread caches.
    pub(super) fn kept_bytes(&self) -> (usize, usize, usize) {
        let kept = self.caches.kept();
        let n = kept.len();
        kept.iter().filter_map(|&p| self.core.live(p)).fold((n, 0, 0), |a, l| (a.0, a.1 + l.block.size, a.2 + l.requested))
    }
}
