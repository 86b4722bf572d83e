//! Which pool owns an address: the address ranges every pool got from its upstream
//! (segments, the arena's reserved ranges), by start address, with the device and the
//! shard of that device's pool (`crate::registry`) that got them. A lookup takes one read
//! lock and no pool lock, where asking each pool in turn would lock up to 64 devices' worth
//! (`Tensor.record_stream`, `base_alloc`, frees naming the wrong device or another stream
//! than the allocation's ask this). The answer is a candidate: the caller confirms with
//! that pool.

use std::collections::BTreeMap;
use std::sync::RwLock;

/// A range's owner: the device and the shard of its pool.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Owner {
    pub device: i32,
    pub shard: u16,
}

static RANGES: RwLock<BTreeMap<usize, (usize, Owner)>> = RwLock::new(BTreeMap::new());

/// `[base, base + len)` now belongs to shard `shard` of `device`'s pool.
pub fn add(base: usize, len: usize, device: i32, shard: u16) {
    if device < 0 || len == 0 {
        return; // the pinned pool's host memory is looked up in that pool itself
    }
    if let Ok(mut r) = RANGES.write() {
        r.insert(base, (len, Owner { device, shard }));
    }
}

/// The range starting at `base`, booked for that pool, goes back to the driver. Only that
/// pool's entry is removed: another pool may already have been given the same address.
pub fn remove(base: usize, device: i32, shard: u16) {
    if let Ok(mut r) = RANGES.write() {
        if r.get(&base).is_some_and(|&(_, o)| o == Owner { device, shard }) {
            r.remove(&base);
        }
    }
}

/// The pool that got the range holding `ptr`, if any.
pub fn lookup(ptr: usize) -> Option<Owner> {
    let r = RANGES.read().ok()?;
    let (&base, &(len, owner)) = r.range(..=ptr).next_back()?;
    (ptr < base + len).then_some(owner)
}
