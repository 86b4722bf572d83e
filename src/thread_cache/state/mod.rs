//! The state a thread's cache shares with the pool it is attached to, below the device
//! pool (which keeps an `AttachedCaches` and offers the operations that need its books:
//! `Pool::attach_thread`, and the kept blocks' return in `pool/free.rs`): the `ThreadCache`
//! type and its word protocol, the limits of each word set, and which caches one pool has
//! attached (module docs of `thread_cache`).
//!
//! The caches' words are shared with their owner threads, which change them without the
//! pool's lock, so every read from the pool's side is a snapshot and every change a
//! compare-and-swap.

mod cache;
mod words;

pub use cache::{ThreadCache, WordSet};
pub use words::WordState;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
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
/// (`pool::UNFENCED_MAX_BYTES`, which checks this at build time).
pub const FENCE_BYTES: usize = 32 << 20;

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
    /// The caches of one pool; `enabled` false: none is ever attached (the pool says when,
    /// `PoolOptions::wants_thread_caches`).
    pub fn new(enabled: bool) -> Self {
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

    /// Clear HANDED(`ptr`) in the cache named by `owner` (a `Live::owner`). `Some(state)`
    /// other than `Handed`: its thread freed it already (a double free).
    pub fn claim(&self, owner: u32, ptr: usize) -> Option<WordState> {
        let (id, kind) = split_owner(owner);
        self.get(id).and_then(|c| c.claim(kind, ptr))
    }

    /// Whether `ptr` is kept (freed) in the cache named by `owner`.
    pub fn is_kept(&self, owner: u32, ptr: usize) -> bool {
        let (id, _) = split_owner(owner);
        self.get(id).is_some_and(|c| c.held().any(|(_, p, h)| p == ptr && h != WordState::Handed))
    }

    fn all(&self) -> impl Iterator<Item = &ThreadCache> {
        self.caches.iter().flatten().map(|c| &**c)
    }

    /// Whether any thread keeps freed blocks that are reusable now (a few atomic loads per
    /// thread).
    pub fn any_reusable(&self) -> bool {
        self.all().any(|c| c.held().any(|(_, _, h)| h == WordState::Reusable))
    }

    /// Every kept (freed) block (reports; the snapshot may be a moment old).
    pub fn kept(&self) -> Vec<usize> {
        self.all().flat_map(|c| c.held().filter(|(_, _, h)| *h != WordState::Handed).map(|(_, p, _)| p)).collect()
    }

    /// Every block held by any cache, with its `Live::owner` value (invariant scan).
    pub fn held(&self) -> Vec<(u32, usize, WordState)> {
        self.all().flat_map(|c| c.held().map(move |(k, p, h)| (owner_of(c.id(), k), p, h))).collect()
    }

    /// Empty every cache's kept words (only the REUSABLE ones if `reusable_only`); the
    /// caller frees the blocks as their state says.
    pub fn take_all_kept(&self, reusable_only: bool) -> Vec<(usize, WordState)> {
        self.all().flat_map(|c| c.take_kept(reusable_only)).collect()
    }

    /// Whether some owner thread has exited (one atomic load).
    pub fn has_orphans(&self) -> bool {
        self.orphans.load(Ordering::Acquire) != 0
    }

    /// Drop the caches of exited threads; returns their kept blocks for the caller to free.
    pub fn reap(&mut self) -> Vec<(usize, WordState)> {
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

