//! Which shard of a device's pool a call goes to: allocations by their stream's placement
//! (`streams.rs`), frees by the shard that holds the block, and the release of the other
//! shards' cache when one runs out of memory (the retry itself is the front end's,
//! `crate::front::allocate`).

use super::{lock_pool, device_pools, with_pool, Error, PoolGuard, Result, MAX_DEVICES, NOT_MADE, DEVICES};
use std::sync::atomic::{AtomicU32, Ordering};

/// Bumped whenever a placement that `shard_for` may have returned changes: a device's
/// shard count (made, configured, installed) or a stream's move (`streams.rs`). The front
/// end remembers its thread's last answer while this stays the same, so a thread that keeps
/// using one stream asks `shard_for` once (`crate::thread_cache`).
static PLACEMENTS: AtomicU32 = AtomicU32::new(0);

/// The current placement epoch (see `PLACEMENTS`).
#[inline]
pub fn placement_epoch() -> u32 {
    PLACEMENTS.load(Ordering::Acquire)
}

/// A placement changed: answers remembered under the previous epoch are stale.
pub(super) fn placements_changed() {
    PLACEMENTS.fetch_add(1, Ordering::AcqRel);
}

/// Whether `stream` is a user stream (one that gets a shard of its own).
fn user_stream(stream: usize) -> bool {
    !crate::stream::is_legacy(stream) && stream != crate::stream::STREAM_PER_THREAD
}

/// The shard that serves allocations on `stream` on `device` (making shard 0 first if
/// needed: it fixes the shard count).
pub fn shard_for(device: i32, stream: usize) -> Result<usize> {
    let s = device_pools(device)?;
    if !user_stream(stream) {
        return Ok(0);
    }
    let mut n = s.stream_shards.load(Ordering::Acquire);
    if n == NOT_MADE {
        with_pool(device, |_| Ok(()))?;
        n = s.stream_shards.load(Ordering::Acquire);
    }
    // While a private pool routes allocations (a graph capture), shard 0 decides where each goes.
    if n == 0 || n == NOT_MADE || crate::pool::routes_active() {
        return Ok(0);
    }
    Ok(s.streams.shard_of(stream, n))
}

/// Whether `device`'s pool is made (read without a lock).
pub fn pool_made(device: i32) -> bool {
    device >= 0 && (device as usize) < MAX_DEVICES && DEVICES[device as usize].stream_shards.load(Ordering::Acquire) != NOT_MADE
}

/// The shard that serves `stream` if that stream ever allocated on `device` (no pool made,
/// nothing placed): where a free on `stream` looks first.
pub fn shard_placed(device: i32, stream: usize) -> Option<usize> {
    if device < 0 || device as usize >= MAX_DEVICES {
        return None;
    }
    let s = &DEVICES[device as usize];
    match s.stream_shards.load(Ordering::Acquire) {
        NOT_MADE => None,
        0 => Some(0),
        _ if !user_stream(stream) => Some(0),
        n => s.streams.placed(stream, n),
    }
}

/// Whether a shard's result is an out-of-memory that the other shards' cached memory could
/// help (not one no release could: `OomReport::hopeless`).
pub fn worth_other_shards<R>(r: &Result<R>) -> bool {
    matches!(r, Err(Error::OutOfMemory(o)) if !o.hopeless)
}

/// After a retry (`crate::front::allocate`): whether the first attempt's out-of-memory is to be taken
/// back. A success never saw it; a second out-of-memory counted the same failure again.
pub fn counted_twice<R>(again: &Result<R>) -> bool {
    matches!(again, Ok(_) | Err(Error::OutOfMemory(_)))
}

/// Shard `except` of `device` is out of memory: every other shard gives back the cached
/// memory it can, each under its own lock. Returns the bytes that went back.
pub fn release_other_shards(device: i32, except: usize) -> usize {
    let Ok(s) = device_pools(device) else { return 0 };
    if s.stream_shards.load(Ordering::Acquire) == NOT_MADE {
        return 0;
    }
    let mut got = 0;
    for (k, m) in s.shards.iter().enumerate() {
        if k == except {
            continue;
        }
        if let Some(p) = lock_pool(m).as_mut() {
            if p.cached_bytes() > 0 {
                got += p.release_for_pressure();
            }
        }
    }
    got
}

/// The shard of `device` that holds `ptr`, locked: the shard `stream` allocates on (blocks
/// are mostly freed where they were allocated), else the one the address index names. A
/// pointer no shard has live goes to the shard whose memory it points into, else shard 0,
/// which judges it (double, interior or unknown). `Ok(None)`: the device has no pool.
pub fn lock_holder(device: i32, ptr: usize, stream: usize) -> Result<Option<PoolGuard>> {
    let s = device_pools(device)?;
    if let Some(k) = shard_placed(device, stream) {
        let g = lock_pool(&s.shards[k]);
        if g.as_ref().is_some_and(|p| p.owns(ptr)) {
            return Ok(Some(PoolGuard(g)));
        }
    }
    let judge = match crate::owners::lookup(ptr) {
        Some(o) if o.device == device && (o.shard as usize) < s.shards.len() => o.shard as usize,
        _ => 0,
    };
    let g = lock_pool(&s.shards[judge]);
    if g.is_some() {
        return Ok(Some(PoolGuard(g)));
    }
    drop(g);
    let g = lock_pool(&s.shards[0]);
    Ok(g.is_some().then(|| PoolGuard(g)))
}
