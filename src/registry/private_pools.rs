//! The registry's side of private pools (CUDA graphs, PyTorch graph pools, `MemPool`s,
//! Note [Graph pools]): which of a device's pools is a private pool's home. A private pool
//! made while its thread allocates under a tag lives in the tag's pool, so that its memory
//! is the tag's and pauses with it (Note [Graph pools under a tag]); any other lives in
//! shard 0. Each later call about the pool (a route's end, a release, a use count) goes to
//! its home, wherever the caller's thread is then.

use super::{device_pools, lock_pool, lock_shard, tag_shard, PoolGuard, Result, POOLS, SHARDS};
use crate::pool::{Filter, Pool, PoolId};
use std::sync::atomic::Ordering;

/// The pool that holds private pool `id` on `device`, if one does.
fn find_home(device: i32, id: PoolId) -> Result<Option<usize>> {
    let s = device_pools(device)?;
    let candidates = std::iter::once(0).chain(SHARDS..POOLS);
    Ok(candidates.into_iter().find(|&i| lock_pool(&s.shards[i]).as_ref().is_some_and(|p| p.holds_private_pool(id))))
}

/// The home of private pool `id` on `device`: where it lives, else where this thread would
/// make it now (its tag's pool, else shard 0).
fn home(device: i32, id: PoolId) -> Result<usize> {
    Ok(find_home(device, id)?.unwrap_or_else(|| crate::tags::current().map_or(0, tag_shard)))
}

/// Lock the pool that holds private pool `id` on `device`; `None` where none does.
fn existing_home(device: i32, id: PoolId) -> Result<Option<PoolGuard>> {
    find_home(device, id)?.map(|shard| lock_shard(device, shard)).transpose()
}

/// Route the allocations `filter` (made under the home's lock) accepts to private pool
/// `id` on `device` (`Pool::begin_allocate_to_pool`), in its home.
pub fn begin_route(device: i32, id: PoolId, filter: impl FnOnce(&mut Pool) -> Result<Filter>) -> Result<()> {
    let shard = home(device, id)?;
    let mut pool = lock_shard(device, shard)?;
    let f = filter(&mut pool)?;
    pool.begin_allocate_to_pool(id, f)?;
    routes_changed(device, shard, &pool);
    Ok(())
}

/// End the latest route to private pool `id` on `device` (`Pool::end_allocate_to_pool`).
pub fn end_route(device: i32, id: PoolId) -> Result<()> {
    let shard = find_home(device, id)?.unwrap_or(0);
    let mut pool = lock_shard(device, shard)?;
    let r = pool.end_allocate_to_pool(id);
    routes_changed(device, shard, &pool);
    let settle = r.is_ok() && !pool.budget().routes_active();
    drop(pool);
    if settle {
        // The device's last route ended: every other pool of it settles too (one lock at
        // a time).
        super::for_each_shard(device, |p| p.settle_after_captures())?;
    }
    r
}

/// One more use of private pool `id` on `device`, made in its home if new.
pub fn create_private_pool(device: i32, id: PoolId) -> Result<()> {
    lock_shard(device, home(device, id)?)?.create_or_incref_pool(id)
}

/// One use of private pool `id` on `device` ended (`Pool::release_pool`); unknown ids
/// release nothing. Returns the bytes given back.
pub fn release_private_pool(device: i32, id: PoolId) -> Result<usize> {
    existing_home(device, id)?.map_or(Ok(0), |mut p| p.release_pool(id))
}

/// The uses of private pool `id` on `device` (0 where it does not exist).
pub fn private_pool_uses(device: i32, id: PoolId) -> Result<i64> {
    Ok(existing_home(device, id)?.map_or(0, |p| p.pool_use_count(id)))
}

/// Give private pool `id`'s memory on `device` back if nothing uses it
/// (`Pool::empty_private_pool`). Returns the bytes given back.
pub fn empty_private_pool(device: i32, id: PoolId) -> Result<usize> {
    existing_home(device, id)?.map_or(Ok(0), |mut p| p.empty_private_pool(id))
}

/// After a route began or ended in `pool` (shard `shard`): whether a tag's pool routes
/// allocations now is kept where the allocation path reads it without a lock.
fn routes_changed(device: i32, shard: usize, pool: &Pool) {
    let Some(tag) = shard.checked_sub(SHARDS) else { return };
    let Ok(s) = device_pools(device) else { return };
    if pool.routes_allocations() {
        s.routed_tags.fetch_or(1 << tag, Ordering::AcqRel);
    } else {
        s.routed_tags.fetch_and(!(1 << tag), Ordering::AcqRel);
    }
}

/// The tag pools of `device` that route allocations now, `first` (a tag's shard) first
/// where it is one of them.
pub fn routed_tag_shards(device: i32, first: Option<usize>) -> Vec<usize> {
    let Ok(s) = device_pools(device) else { return Vec::new() };
    let mask = s.routed_tags.load(Ordering::Acquire);
    if mask == 0 {
        return Vec::new();
    }
    let mut out: Vec<usize> = (0..crate::tags::MAX_TAGS).filter(|t| mask & (1 << t) != 0).map(tag_shard).collect();
    if let Some(i) = first.and_then(|f| out.iter().position(|&s| s == f)) {
        out[..=i].rotate_right(1);
    }
    out
}
