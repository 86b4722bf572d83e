//! The pool's side of the per-thread fast path (`crate::thread_cache`): which threads'
//! caches belong to this pool, and emptying their parked blocks back into it.
//!
//! Everything here runs under the device lock. The caches' words are shared with their
//! owner threads, which change them without the lock, so every read here is a snapshot and
//! every change a compare-and-swap (see `thread_cache.rs` for the protocol).

use crate::thread_cache::{Hold, ThreadCache};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// `Live::owner` of a block no thread cache may hold.
pub const NO_OWNER: u32 = u32::MAX;

/// Pools get distinct ids, so a thread's cache from a pool that was since replaced
/// (`gpupool_configure`) is recognised as stale.
static NEXT_POOL_ID: AtomicU64 = AtomicU64::new(1);

pub struct ThreadCaches {
    enabled: bool,
    pool_id: u64,
    /// Caches by id; `None` = a free id.
    caches: Vec<Option<Arc<ThreadCache>>>,
    free_ids: Vec<u32>,
    /// Bumped by each exiting owner thread (`thread_cache::Mine::drop`).
    orphans: Arc<AtomicUsize>,
    /// Fast-path (allocations, frees) of caches already dropped.
    retired: (u64, u64),
}

impl ThreadCaches {
    pub fn new(enabled: bool) -> Self {
        ThreadCaches {
            enabled,
            pool_id: NEXT_POOL_ID.fetch_add(1, Ordering::Relaxed),
            caches: Vec::new(),
            free_ids: Vec::new(),
            orphans: Arc::new(AtomicUsize::new(0)),
            retired: (0, 0),
        }
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
        let cache = Arc::new(ThreadCache::new(self.pool_id, id, self.orphans.clone()));
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

    pub fn get(&self, id: u32) -> Option<&ThreadCache> {
        self.caches.get(id as usize).and_then(|c| c.as_deref())
    }

    /// Clear HANDED(`ptr`) in cache `owner`; `Some(Hold::Parked)` if its thread freed it.
    pub fn claim(&self, owner: u32, ptr: usize) -> Option<Hold> {
        self.get(owner).and_then(|c| c.claim(ptr))
    }

    /// Whether `ptr` sits parked in cache `owner` (i.e. was freed already).
    pub fn is_parked(&self, owner: u32, ptr: usize) -> bool {
        self.get(owner).is_some_and(|c| c.held().any(|h| h == (ptr, Hold::Parked)))
    }

    fn all(&self) -> impl Iterator<Item = &ThreadCache> {
        self.caches.iter().flatten().map(|c| &**c)
    }

    /// Whether any thread has parked blocks (cheap: a few atomic loads per thread).
    pub fn any_parked(&self) -> bool {
        self.all().any(|c| c.held().any(|(_, h)| h == Hold::Parked))
    }

    /// Every parked block, by owner (reports; the snapshot may be a moment old).
    pub fn parked(&self) -> Vec<usize> {
        self.all().flat_map(|c| c.held().filter(|(_, h)| *h == Hold::Parked).map(|(p, _)| p)).collect()
    }

    /// Every block held by any cache, with its cache id (invariant scan).
    pub fn held(&self) -> Vec<(u32, usize, Hold)> {
        self.all().flat_map(|c| c.held().map(move |(p, h)| (c.id(), p, h))).collect()
    }

    /// Empty the parked words of cache `id`; the caller frees the blocks.
    pub fn take_parked_of(&self, id: u32) -> Vec<usize> {
        self.get(id).map(ThreadCache::take_parked).unwrap_or_default()
    }

    /// Empty every cache's parked words; the caller frees the blocks.
    pub fn take_all_parked(&self) -> Vec<usize> {
        self.all().flat_map(ThreadCache::take_parked).collect()
    }

    /// Drop the caches of exited threads; returns their parked blocks for the caller to free.
    pub fn reap(&mut self) -> Vec<usize> {
        if self.orphans.load(Ordering::Acquire) == 0 {
            return Vec::new();
        }
        let mut out = Vec::new();
        for id in 0..self.caches.len() {
            let Some(c) = self.caches[id].as_ref() else { continue };
            if !c.is_orphaned() {
                continue;
            }
            out.extend(c.take_parked());
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
