//! Which device owns an address: the address ranges every pool got from its upstream
//! (segments, the arena's reserved ranges), by start address. A lookup takes one read lock
//! and no pool lock, where asking each device's pool in turn would lock up to 64 of them
//! (`Tensor.record_stream`, `base_alloc` and frees naming the wrong device ask this).
//! The answer is a candidate: the caller confirms with that device's pool.

use std::collections::BTreeMap;
use std::sync::RwLock;

static RANGES: RwLock<BTreeMap<usize, (usize, i32)>> = RwLock::new(BTreeMap::new());

/// `[base, base + len)` now belongs to `device`'s pool.
pub fn add(base: usize, len: usize, device: i32) {
    if device < 0 || len == 0 {
        return; // the pinned pool's host memory is looked up in that pool itself
    }
    if let Ok(mut r) = RANGES.write() {
        r.insert(base, (len, device));
    }
}

/// The range starting at `base`, booked for `device`, goes back to the driver. Only that
/// device's entry is removed: another pool may already have been given the same address.
pub fn remove(base: usize, device: i32) {
    if let Ok(mut r) = RANGES.write() {
        if r.get(&base).is_some_and(|&(_, d)| d == device) {
            r.remove(&base);
        }
    }
}

/// The device whose pool got the range holding `ptr`, if any.
pub fn lookup(ptr: usize) -> Option<i32> {
    let r = RANGES.read().ok()?;
    let (&base, &(len, device)) = r.range(..=ptr).next_back()?;
    (ptr < base + len).then_some(device)
}
