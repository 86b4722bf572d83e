//! The front end: the library's operations as Rust calls, which the C boundary marshals.
//! Here, where every allocation and free of the C API, PyTorch's and CuPy's entries begins,
//! and the one place an allocation that ran out of memory is tried again; beside it, what is
//! asked of a device beyond that (`device.rs`: reports, limits, reclaim, configuration,
//! peers, questions about a live block), tags (`tags.rs`), private pools
//! (`private_pools.rs`) and the pinned pool (`pinned.rs`).
//!
//! An allocation walks down and never back up: this thread's cache
//! (`crate::thread_cache`, no lock), else the shard the registry names
//! (`registry::lock_stream_shard`, a guard held here), the pool under that guard
//! (`Pool::malloc`, `Pool::malloc_owned`), its strategy, the upstream. Out of memory on one
//! shard while the device's other shards cache memory: they give it back, each under its
//! own lock (`registry::release_other_shards`), and the allocation runs once more
//! (`allocate`). A free goes to the thread's cache where that thread kept the block, else
//! to the shard that holds it (`registry::lock_holder`).
//!
//! An allocation under a tag (`crate::tags`) goes to the tag's own pool
//! (`registry::tag_shard`), whose memory can be paused and resumed apart (`docs/tags.md`);
//! its free finds that pool as any free finds its shard.
//!
//! Why the front end holds the guard rather than handing the registry a closure: the
//! steps of a locked allocation (attaching the thread's cache, handing back its reusable
//! blocks, remembering the new block) are the front end's, and a closure run by the
//! registry would make the walk go back up into them.

pub mod device;
pub mod pinned;
pub mod private_pools;
pub mod tags;

use crate::error::{BadPointer, Error, Result};
use crate::pool::{FreeOn, Pool};
use crate::registry;
use crate::stream::STREAM_LEGACY;
use crate::thread_cache::{self, fast_path_stream, ThreadCache, WordSet};
use std::sync::Arc;

/// Allocate `size` bytes on `device` for `stream`: a block this thread kept for that
/// stream, else the pool.
pub fn malloc(device: i32, size: usize, stream: usize) -> Result<usize> {
    if size == 0 {
        return empty(device, stream);
    }
    if crate::pool::routes_active() {
        return malloc_while_routed(device, size, stream);
    }
    if let Some(tag) = crate::tags::current() {
        return allocate(device, registry::tag_shard(tag), stream, |pool| pool.malloc(size, stream));
    }
    // The per-thread default stream takes the locked path.
    if !fast_path_stream(stream) || crate::process::in_child() {
        let shard = registry::shard_for(device, stream)?;
        return allocate(device, shard, stream, |pool| pool.malloc(size, stream));
    }
    malloc_kind(device, size, stream, WordSet::Ordered)
}

/// Allocate for a caller that names no stream (CuPy): a fenced block this thread kept,
/// else the pool.
pub fn malloc_unordered(device: i32, size: usize) -> Result<usize> {
    if size == 0 {
        return empty(device, STREAM_LEGACY);
    }
    if crate::pool::routes_active() {
        return malloc_while_routed(device, size, STREAM_LEGACY);
    }
    if let Some(tag) = crate::tags::current() {
        return allocate(device, registry::tag_shard(tag), STREAM_LEGACY, |pool| pool.malloc(size, STREAM_LEGACY));
    }
    if crate::process::in_child() {
        return allocate(device, 0, STREAM_LEGACY, |pool| pool.malloc(size, STREAM_LEGACY));
    }
    malloc_kind(device, size, STREAM_LEGACY, WordSet::Unordered)
}

/// An allocation while a private pool routes allocations somewhere in the process (a CUDA
/// graph capture, a `MemPool` scope; the thread caches step aside). A route takes it first:
/// a tag's pool's routes (this thread's tag's first: a capture begun under a tag), then
/// shard 0's (one begun outside every tag), so that a capture's memory is the graph's
/// whichever tag the allocating thread is under; else the thread's tag's pool serves it,
/// or shard 0 an untagged one (`registry::shard_for` names it while routes are active). A
/// tag (`crate::tags`) has a pool of its own, served without the thread cache (a tag's
/// blocks are few and long-lived: weights, caches).
fn malloc_while_routed(device: i32, size: usize, stream: usize) -> Result<usize> {
    if let Some(p) = routed_elsewhere(device, size, stream)? {
        return Ok(p);
    }
    let tag = crate::tags::current().map(registry::tag_shard);
    match tag {
        Some(shard) => {
            if let Some(p) = allocate(device, 0, stream, |pool| pool.malloc_if_routed(size, stream))? {
                return Ok(p);
            }
            allocate(device, shard, stream, |pool| pool.malloc(size, stream))
        }
        None => allocate(device, registry::shard_for(device, stream)?, stream, |pool| pool.malloc(size, stream)),
    }
}

/// Allocate for a caller whose capture the pool must detect itself (CuPy on a user stream):
/// a route takes it first (`routed_elsewhere`, then shard 0's); a capture it detects that
/// nobody announced starts a private pool in shard 0, outside tags.
pub fn malloc_detecting_capture(device: i32, size: usize, stream: usize) -> Result<usize> {
    if crate::pool::routes_active() {
        if let Some(p) = routed_elsewhere(device, size, stream)? {
            return Ok(p);
        }
    }
    if let Some(tag) = crate::tags::current() {
        // Under a tag, the tag's pool serves it unless the stream is capturing (the graph's
        // private pool in shard 0 does then).
        let served = allocate(device, registry::tag_shard(tag), stream, |pool| match pool.capture_of(stream)? {
            None => pool.malloc(size, stream).map(Some),
            Some(_) => Ok(None),
        })?;
        if let Some(p) = served {
            return Ok(p);
        }
    }
    allocate(device, 0, stream, |pool| pool.malloc_detecting_capture(size, stream))
}

/// An allocation a tag's pool's route takes (`malloc_while_routed`'s first step).
fn routed_elsewhere(device: i32, size: usize, stream: usize) -> Result<Option<usize>> {
    let tag = crate::tags::current().map(registry::tag_shard);
    for shard in registry::routed_tag_shards(device, tag) {
        if let Some(p) = allocate(device, shard, stream, |pool| pool.malloc_if_routed(size, stream))? {
            return Ok(Some(p));
        }
    }
    Ok(None)
}

/// Run the allocation `attempt` on `shard` of `device`. Out of memory there while other
/// shards hold cached memory (and not out of reach of any release, `OomReport::hopeless`):
/// they give it back and `attempt` runs once more; the failure is counted once either way
/// (`registry::counted_twice`). The only retry of an allocation.
pub fn allocate<R>(device: i32, shard: usize, stream: usize, mut attempt: impl FnMut(&mut Pool) -> Result<R>) -> Result<R> {
    // The guard goes at the end of the statement: a thread holds one shard's lock at a
    // time, and the release below takes the others'.
    let first = attempt(&mut *registry::lock_stream_shard(device, shard, stream)?);
    if !registry::worth_other_shards(&first) || registry::release_other_shards(device, shard) == 0 {
        return first;
    }
    let mut pool = registry::lock_shard(device, shard)?;
    let again = attempt(&mut pool);
    if registry::counted_twice(&again) {
        pool.retract_oom();
    }
    again
}

/// An allocation that may take the thread's fast path: a block this thread kept, else a
/// locked allocation that attaches the thread's cache to the pool (making one the first
/// time) and, where the thread's sizes repeat, lets the cache remember the new block.
fn malloc_kind(device: i32, size: usize, stream: usize, kind: WordSet) -> Result<usize> {
    let shard = thread_cache::shard_for(device, stream)?;
    if let Some(p) = thread_cache::reuse(device, shard, kind, size, stream) {
        return Ok(p);
    }
    let mine = thread_cache::mine(device, shard);
    let mut fresh: Option<Arc<ThreadCache>> = None;
    let r = allocate(device, shard, stream, |pool| {
        let (r, made) = thread_cache::malloc_attached(pool, kind, size, stream, fresh.as_deref().or(mine.as_deref()));
        if fresh.is_none() {
            fresh = made;
        }
        r
    });
    if let Some(cache) = fresh {
        thread_cache::adopt(device, shard, cache);
    }
    r
}

/// An allocation of nothing: NULL, with no pool's lock taken once the device's pool is
/// made (a framework makes empty tensors, each an allocation of 0 bytes, while another
/// thread may hold the pool for long driver work: an import made ahead,
/// `ffi::share_ahead`). A pool that stopped after an internal error answers so too: it
/// hands out no memory. A fork child, and a device whose pool is not made yet, go the
/// pool's way, which says what is wrong (no driver, a bad device, the fork).
fn empty(device: i32, stream: usize) -> Result<usize> {
    if crate::process::in_child() || !registry::pool_made(device) {
        let shard = registry::shard_for(device, stream)?;
        return allocate(device, shard, stream, |pool| pool.malloc(0, stream));
    }
    thread_cache::shard_for(device, stream)?;
    Ok(0)
}

/// Free `ptr` on `device`, last used on `stream` (the C API, PyTorch): kept by this
/// thread's cache where it allocated the block for that stream, else freed by its shard.
pub fn free(ptr: usize, device: i32, stream: usize) -> Result<()> {
    if kept_by_thread(ptr, device, stream) {
        return Ok(());
    }
    free_in_pool(ptr, device, stream, FreeOn::Stream(stream))
}

/// Free `ptr` for a caller that names no stream (CuPy without its stream getter): kept
/// UNFENCED by this thread's cache, else the pool's stream-less free.
pub fn free_unordered(ptr: usize, device: i32) -> Result<()> {
    if ptr != 0 && thread_cache::try_free_unordered(device, ptr) {
        return Ok(());
    }
    free_in_pool(ptr, device, STREAM_LEGACY, FreeOn::Unordered)
}

/// CuPy's allocation, on the stream its stream getter names (`None`: it has none, and the
/// free will name no stream either): the legacy stream takes the same fast path as
/// PyTorch's and the C API's; any other stream goes to shard 0, where a capture it detects
/// starts a private pool.
pub fn malloc_for_cupy(device: i32, size: usize, current: Option<usize>) -> Result<usize> {
    match current {
        None => malloc_unordered(device, size),
        Some(s) if crate::stream::is_legacy(s) => malloc(device, size, STREAM_LEGACY),
        Some(s) => malloc_detecting_capture(device, size, s),
    }
}

/// `kept_by_thread` on the legacy stream: CuPy's frees, whose fast path holds only blocks
/// allocated there.
pub fn kept_by_thread_on_legacy(ptr: usize, device: i32) -> bool {
    kept_by_thread(ptr, device, STREAM_LEGACY)
}

/// Whether this thread's cache kept `ptr` as freed on `stream` (it allocated the block
/// for that stream and still holds it): the free is done, with no lock.
pub fn kept_by_thread(ptr: usize, device: i32, stream: usize) -> bool {
    ptr != 0 && thread_cache::try_free(device, ptr, stream)
}

/// Free `ptr` in its pool on the stream it was allocated for (CuPy with its stream getter,
/// after `kept_by_thread` said no; `current`: the caller's current stream, alive now).
pub fn free_as_allocated(ptr: usize, device: i32, current: Option<usize>) -> Result<()> {
    free_in_pool(ptr, device, current.unwrap_or(STREAM_LEGACY), FreeOn::AsAllocated { current })
}

/// Free `ptr` on `device` as `on` says, in the shard that holds it (`stream`: the freeing
/// stream, where to look first). A pointer unknown to that device's pool is reported with
/// the device that does own it, if any.
fn free_in_pool(ptr: usize, device: i32, stream: usize, on: FreeOn) -> Result<()> {
    if ptr == 0 {
        return Ok(());
    }
    // The shard's lock goes with the statement: `find_owner` below asks the others.
    let freed = registry::lock_holder(device, ptr, stream)?.map(|mut pool| pool.free(ptr, on));
    match freed {
        Some(Ok(())) => Ok(()),
        Some(Err(Error::InvalidPointer { why: BadPointer::Unknown, .. })) | None => Err(match registry::find_owner(ptr) {
            Some(d) => Error::InvalidArgument(format!(
                "free of pointer {ptr:#x} on device {device}: it was allocated on device {d}; pass that device"
            )),
            None => Error::InvalidPointer { ptr, device, why: BadPointer::Unknown },
        }),
        Some(Err(e)) => Err(e),
    }
}
