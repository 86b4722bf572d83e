//! The locked part of an allocation that may take the fast path, on the owner thread under
//! the shard's lock (`front` calls it inside its allocation, out-of-memory retry included):
//! attach the thread's cache to the pool, let the magazine fence and reuse, else allocate
//! from the pool and remember the block where the thread's sizes repeat.

use super::fast_stream;
use super::state::{owner_of, ThreadCache, WordSet, FENCE_BATCH, FENCE_BYTES};
use crate::error::Result;
use crate::pool::Pool;
use std::sync::Arc;

/// The locked part of an allocation, on the owner thread under the shard's lock: attach
/// this thread's cache (making one if needed: the second value), let the magazine fence
/// and reuse, else allocate from the pool and remember the block.
pub fn malloc_attached(pool: &mut Pool, kind: WordSet, size: usize, stream: usize, mine: Option<&ThreadCache>) -> (Result<usize>, Option<Arc<ThreadCache>>) {
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
    for (p, state) in back {
        pool.release_kept(p, state, Some(stream));
    }
    if kind == WordSet::Unordered {
        // SAFETY: the owner thread (we run inside its allocation call).
        let unfenced = unsafe { &mut *cache.unfenced.get() };
        // A fence that fails leaves them unfenced (not reusable), for the next allocation's.
        if (unfenced.0 >= FENCE_BATCH || unfenced.1 >= FENCE_BYTES) && pool.fence_legacy_now() {
            cache.unordered.fenced();
            *unfenced = (0, 0);
        }
        if let Some(p) = cache.reuse(kind, size, fast_stream(stream)) {
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
        for (p, state) in back {
            pool.release_kept(p, state, Some(stream));
        }
    }
    let words_repeat = match kind {
        WordSet::Ordered => cache.ordered.repeats(size),
        WordSet::Unordered => cache.unordered.repeats(size),
    };
    if !words_repeat {
        return (pool.malloc(size, stream), fresh);
    }
    let r = pool.malloc_owned(size, stream, owner_of(id, kind));
    if let Ok(p) = r {
        cache.remember(kind, p, size, fast_stream(stream));
    }
    (r, fresh)
}

