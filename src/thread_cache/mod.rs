//! Per-thread fast path, on every stream but the per-thread default stream: a free followed by an allocation of
//! the same size on the same thread skips the device lock, the live-pointer map and the
//! strategy.
//!
//! Why: a cached malloc+free pair through the locked pool spends most of its time in two
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
//! - Each kept block remembers the stream it was allocated for: it is kept only when freed
//!   on that stream, and handed back only to an allocation on that stream, so stream order
//!   alone protects it and no event is needed. When it goes back to the pool, the pool
//!   records its stream's event only if that stream is the one of the operation in
//!   progress (alive now): its user may have destroyed it since the free, and recording on
//!   a destroyed stream crashes inside the driver. Otherwise the block stays on its stream
//!   (as with `FreeOn::AsAllocated`) until that stream records again or the device is
//!   synchronised. A destroyed stream's handle can be recycled, but only after its queued
//!   work completed (the driver releases a stream's resources then), so a recycled handle
//!   hides nothing.
//!   The per-thread default stream's handle names a different stream on each thread; its
//!   operations always go through the pool.
//! - CuPy's frees name no stream, and the pool's rule for them (`FreeOn::Unordered`) is
//!   that a block is reused only after a fence enqueued on the legacy stream after its free.
//!   The magazine keeps that rule: a CuPy free marks the word UNFENCED; once enough are
//!   waiting, the owner's next locked allocation records one fence and makes them all
//!   REUSABLE (a fence the driver refuses leaves them UNFENCED, for the next one). One lock
//!   and one event record serve `FENCE_BATCH` pairs, as the pool's own batching does.
//! - Off where every operation must reach the pool: `GPUPOOL_DEBUG`, `GPUPOOL_TRACE`,
//!   `GPUPOOL_POOL=none`, `GPUPOOL_THREAD_CACHE=0`; and under the test-only
//!   `GPUPOOL_UNSAFE_IGNORE_STREAMS`, whose pool must reuse at once to show the stream tests
//!   catch it.


// The words a thread and its device's pool share live in the pool layer (the pool must
// claim and empty them under its lock); this module owns the thread-local side.
mod attach;
pub mod state;

pub use attach::malloc_attached;
pub use state::{WordState, ThreadCache, WordSet, FENCE_BATCH, FENCE_BYTES, MAGAZINE, WORDS};

use crate::error::Result;
use crate::registry::{self, MAX_DEVICES};
use crate::stream::STREAM_LEGACY;
use std::cell::{Cell, RefCell};
use std::sync::atomic::Ordering;
use std::sync::Arc;



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
    /// This thread's last answer of `registry::shard_for` (`Placement`).
    static PLACEMENT: Cell<Placement> = const { Cell::new(Placement::NONE) };
}

/// The shard that served this thread's last call on (`device`, `stream`), valid while the
/// registry's placement epoch stays `epoch`. Why: a thread mostly stays on one stream, and
/// asking the registry costs two stream-table probes per pair (one to allocate, one to
/// free), a large share of the fast path (`bench/diagnostics/instr_per_step.rs streampair` counts
/// its instructions). Placements change rarely (a device remade, a stream that shared its shard
/// moved), and each change bumps the epoch. A stale answer could only misplace an
/// allocation, never lose a block: frees find their pool through the address index.
#[derive(Clone, Copy)]
struct Placement {
    device: i32,
    stream: usize,
    epoch: u32,
    shard: u32,
}

impl Placement {
    const NONE: Placement = Placement { device: -1, stream: 0, epoch: 0, shard: 0 };
}

/// `registry::shard_for(device, stream)`, remembered for the thread's next call.
#[inline]
pub fn shard_for(device: i32, stream: usize) -> Result<usize> {
    let epoch = registry::placement_epoch();
    let last = PLACEMENT.try_with(Cell::get).unwrap_or(Placement::NONE);
    // `Placement::NONE` names device -1: a bad device id must reach the registry's check.
    if device >= 0 && last.device == device && last.stream == stream && last.epoch == epoch {
        return Ok(last.shard as usize);
    }
    // The epoch is read before the registry answers: a change meanwhile makes the next
    // call ask again.
    let shard = registry::shard_for(device, stream)?;
    if !crate::pool::routes_active() {
        let _ = PLACEMENT.try_with(|r| r.set(Placement { device, stream, epoch, shard: shard as u32 }));
    }
    Ok(shard)
}

/// `registry::shard_placed(device, stream)`, from the remembered route when it matches.
fn placed(device: i32, stream: usize) -> Option<usize> {
    let last = PLACEMENT.try_with(Cell::get).unwrap_or(Placement::NONE);
    if last.device == device && last.stream == stream && last.epoch == registry::placement_epoch() {
        return Some(last.shard as usize);
    }
    registry::shard_placed(device, stream)
}

/// Run `f` on this thread's cache for the shard of `device` that serves `stream`, if the
/// stream allocated there before and this thread has one.
fn with_mine<R>(device: i32, stream: usize, f: impl FnOnce(&ThreadCache) -> Option<R>) -> Option<R> {
    if device < 0 || device as usize >= MAX_DEVICES {
        return None;
    }
    let idx = cache_index(device, placed(device, stream)?);
    // `try_with`: during thread teardown the TLS may be gone; the locked path still works.
    MINE.try_with(|m| m.0.borrow().get(idx).and_then(|c| c.as_deref()).and_then(f)).ok().flatten()
}

/// A block this thread kept for (`kind`, `size`, `stream`) in its cache for `shard` of
/// `device`, handed out again: the allocation's hit, with no lock.
pub fn reuse(device: i32, shard: usize, kind: WordSet, size: usize, stream: usize) -> Option<usize> {
    let idx = cache_index(device, shard);
    MINE.try_with(|m| m.0.borrow().get(idx).and_then(|c| c.as_deref()).and_then(|c| c.reuse(kind, size, fast_stream(stream))))
        .ok()
        .flatten()
}

/// This thread's cache for `shard` of `device`, if it has one (for a locked allocation,
/// which attaches it to the pool).
pub fn mine(device: i32, shard: usize) -> Option<Arc<ThreadCache>> {
    let idx = cache_index(device, shard);
    MINE.try_with(|m| m.0.borrow().get(idx).and_then(|c| c.clone())).ok().flatten()
}

/// Keep `cache`, which the pool made for this thread (`Pool::attach_thread`), as this
/// thread's cache for `shard` of `device`. During thread teardown there is nowhere to keep
/// it: dropped, the pool finds it orphaned.
pub fn adopt(device: i32, shard: usize, cache: Arc<ThreadCache>) {
    let idx = cache_index(device, shard);
    let kept = MINE.try_with(|m| {
        let mut v = m.0.borrow_mut();
        if v.len() <= idx {
            v.resize(idx + 1, None);
        }
        v[idx] = Some(cache.clone());
    });
    if kept.is_err() {
        cache.orphaned.store(true, Ordering::Release);
        cache.orphans.fetch_add(1, Ordering::AcqRel);
    }
}

/// Where this thread keeps its cache for `shard` of `device`.
#[inline]
fn cache_index(device: i32, shard: usize) -> usize {
    device as usize * registry::SHARDS + shard
}

/// The stream as the fast path names it: the legacy stream's two handles as one.
#[inline]
pub fn fast_stream(stream: usize) -> usize {
    if crate::stream::is_legacy(stream) {
        STREAM_LEGACY
    } else {
        stream
    }
}

/// Whether frees and allocations on `stream` may take the fast path: every stream but the
/// per-thread default stream (whose handle names another stream on each thread, which the
/// pool must resolve when it takes a kept block back).
#[inline]
pub fn fast_path_stream(stream: usize) -> bool {
    stream != crate::stream::STREAM_PER_THREAD
}

/// Fast free: keep `ptr` if this thread allocated it for `stream` and still holds it (the
/// next allocation of its size on that stream, on this thread, takes it back: stream order
/// protects it). `false`: the caller frees through the pool.
pub fn try_free(device: i32, ptr: usize, stream: usize) -> bool {
    fast_path_stream(stream)
        && !crate::process::in_child()
        && with_mine(device, stream, |c| c.keep(WordSet::Ordered, ptr, fast_stream(stream)).then_some(())).is_some()
}

/// Fast stream-less free (CuPy): keep `ptr` as UNFENCED if this thread allocated it so.
pub fn try_free_unordered(device: i32, ptr: usize) -> bool {
    !crate::process::in_child() && with_mine(device, STREAM_LEGACY, |c| c.keep(WordSet::Unordered, ptr, STREAM_LEGACY).then_some(())).is_some()
}

/// A block this thread kept on `device` for `size` bytes, handed out again (tests).
pub fn try_malloc(device: i32, size: usize, stream: usize) -> Option<usize> {
    if !fast_path_stream(stream) {
        return None;
    }
    with_mine(device, stream, |c| c.reuse(WordSet::Ordered, size, fast_stream(stream)))
}

/// The (pool id, cache id) of this thread's cache for `device`'s shard 0, if it has one.
pub fn current(device: i32) -> Option<(u64, u32)> {
    with_mine(device, STREAM_LEGACY, |c| Some((c.pool_id, c.id)))
}

