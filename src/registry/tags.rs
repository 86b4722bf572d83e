//! The registry's side of tags (`crate::tags`, `docs/tags.md`): each tag has a pool of its
//! own on each device, after the device's shards, made when the first allocation under
//! the tag reaches that device; pausing and resuming a tag pause and resume those pools.

use super::{device_pools, existing_devices, lock_pool, Result, SHARDS};
use crate::error::Error;
use crate::pool::Pool;
use crate::tags::TagMemory;

/// The index of tag `tag`'s pool among a device's pools.
pub fn tag_shard(tag: usize) -> usize {
    SHARDS + tag
}

/// The tag of pool `shard`, if it is a tag's.
pub(super) fn tag_of_shard(shard: usize) -> Option<String> {
    shard.checked_sub(SHARDS).and_then(crate::tags::name)
}

/// Run `f` on tag `name`'s pool on `device` (every device whose pool exists: `device` < 0)
/// where it exists; returns the sum of what `f` returns. A name never used is refused (a
/// misspelt tag must not pause nothing quietly).
fn each_tag_pool(device: i32, name: &str, mut f: impl FnMut(&mut Pool) -> Result<usize>) -> Result<usize> {
    let Some(tag) = crate::tags::lookup(name) else {
        return Err(Error::InvalidArgument(format!(
            "tag {name:?}: this process never named it (gpupool.tag / gpupool_tag_begin), so nothing is under it"
        )));
    };
    let devices = if device < 0 { existing_devices() } else { vec![device] };
    let mut total = 0;
    for d in devices {
        let s = device_pools(d)?;
        if let Some(p) = lock_pool(&s.shards[tag_shard(tag)]).as_mut() {
            total += f(p)?;
        }
    }
    Ok(total)
}

/// Why tag `name`'s pool `p` on `device` cannot be replaced by one of other memory, if
/// it cannot: it holds memory (live, paused), a private pool (a graph or `MemPool` made under
/// the tag, which keeps its memory), or a route into one is active.
fn not_replaceable(p: &mut Pool, name: &str, device: i32) -> Option<String> {
    p.flush_thread_caches(None);
    let live = p.live_count();
    let private_pools = p.private_pool_summary().0;
    if p.is_paused() {
        Some(format!("its memory on device {device} is paused; resume it and free what is under it first"))
    } else if live > 0 {
        Some(format!("{live} live allocation(s) under it on device {device}; free them first"))
    } else if p.routes_allocations() || private_pools > 0 {
        Some(format!(
            "{private_pools} CUDA graph or MemPool pool(s) made under it hold memory on device {device}; destroy \
             them (the graphs, the MemPools) first"
        ))
    } else {
        let _ = name;
        None
    }
}

/// Make tag `name`'s memory of `kind` (Note [A tag's memory]), naming the tag now if it is
/// new. Refused, with nothing changed, while a pool of the tag holds memory on any device
/// (`not_replaceable`); pools of the tag that hold none are dropped, so that its next
/// allocation on each device makes a pool of `kind`. An allocation under the tag that
/// races with this call is either in a pool of `kind` or makes the call refuse, its choice
/// undone.
pub fn place_tag(name: &str, kind: TagMemory) -> Result<()> {
    let tag = crate::tags::index_of(name)?;
    let old = crate::tags::memory(tag);
    if old == kind {
        return Ok(());
    }
    let refuse = |why: String| {
        Error::Busy(format!(
            "place tag {name:?} as {}: its memory is {} already and is chosen before its first allocation; {why}",
            kind.name(),
            old.name()
        ))
    };
    let devices = existing_devices();
    for &d in &devices {
        let s = device_pools(d)?;
        if let Some(why) = lock_pool(&s.shards[tag_shard(tag)]).as_mut().and_then(|p| not_replaceable(p, name, d)) {
            return Err(refuse(why));
        }
    }
    crate::tags::set_memory(tag, kind);
    // Each pool is checked again under the lock that drops it: an allocation made since
    // the check above keeps it, and the choice is undone.
    for d in devices {
        let s = device_pools(d)?;
        let mut g = lock_pool(&s.shards[tag_shard(tag)]);
        if let Some(p) = g.as_mut() {
            if let Some(why) = not_replaceable(p, name, d) {
                crate::tags::set_memory(tag, old);
                return Err(refuse(why));
            }
            // Dropping the idle pool gives its cached memory back.
            *g = None;
        }
    }
    Ok(())
}

/// Pause tag `name` on `device` (< 0: every device): `Pool::pause`. Returns the bytes
/// given back to the driver. A device where the tag is paused already counts as done, so
/// a pause over several devices that failed on one can be asked again.
pub fn pause_tag(device: i32, name: &str, stream: usize, backup: bool) -> Result<usize> {
    if crate::tags::lookup(name).is_some_and(|t| crate::tags::memory(t) == TagMemory::CudaIpc) {
        return Err(Error::InvalidArgument(format!(
            "pause `{name}`: the tag's memory is placed as cuda-ipc (gpupool.place_tag / gpupool_tag_place), \
             `cuMemAlloc` segments that any receiver opens but that cannot be given back at a kept address; free \
             what is under it to give its memory back (gpupool.empty_cache), or keep what must sleep under a \
             pausable tag"
        )));
    }
    if device < 0 {
        // Over every device, a receiver still mapping the tag's memory on any refuses the
        // pause before any device pauses: each device's exports are marked closing first,
        // and those marks are undone where one refuses.
        let mut closed = Vec::new();
        let checked = each_tag_pool(device, name, |p| {
            if !p.is_paused() {
                p.exports().close_for_pause(name)?;
                closed.push(p.device());
            }
            Ok(0)
        });
        if let Err(e) = checked {
            for d in closed {
                let _ = each_tag_pool(d, name, |p| {
                    p.exports().reopen();
                    Ok(0)
                });
            }
            return Err(e);
        }
    }
    let paused = each_tag_pool(device, name, |p| if p.is_paused() { Ok(0) } else { p.pause(name, stream, backup) });
    if paused.is_err() && device < 0 {
        // The devices not paused take imports of the tag's blocks again.
        let _ = each_tag_pool(device, name, |p| {
            if !p.is_paused() {
                p.exports().reopen();
            }
            Ok(0)
        });
    }
    paused
}

/// Resume tag `name` on `device` (< 0: every device): `Pool::resume`.
pub fn resume_tag(device: i32, name: &str) -> Result<usize> {
    each_tag_pool(device, name, |p| p.resume())
}

/// Bytes of tag `name` paused on `device` (< 0: every device).
pub fn tag_paused_bytes(device: i32, name: &str) -> Result<usize> {
    each_tag_pool(device, name, |p| Ok(p.paused_bytes()))
}

/// Make the host memory tag `name`'s next pause with a backup copies into now, on `device`
/// (< 0: every device), as large as the tag's memory; returns its bytes.
pub fn tag_backup_prepare(device: i32, name: &str) -> Result<usize> {
    each_tag_pool(device, name, |p| p.prepare_pause_backup())
}

/// Give back the host memory kept for tag `name`'s next backup on `device` (< 0: every
/// device); returns its bytes.
pub fn tag_backup_drop(device: i32, name: &str) -> Result<usize> {
    each_tag_pool(device, name, |p| Ok(p.drop_pause_backup()))
}
