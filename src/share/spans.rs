//! The spans of another process's allocations this process maps once for every block in
//! them it holds (`SHARED` says why and when that is safe): opening a descriptor through a
//! span already mapped (`open_shared`) and letting a block's part of one go (`unshare`).

use super::descriptor::AnyDescriptor;
use crate::error::Result;
use crate::registry;
use std::ffi::c_int;

/// An exporter's mapped span: its pid, start time, device, the address of its first
/// granule there, its granule count, and a number of its own (a span can be mapped again
/// while the first mapping lives, see `covering`).
pub type SpanKey = (u32, u64, i32, u64, usize, u64);

/// An exporter's hold on one of its blocks (`holds`): its holds file and slot.
pub type SendHold = ((u64, u64), u32);

/// A span of another process's allocations mapped here once for every block in it this
/// process holds: where it starts here, the address its import returned (what closes it),
/// its granule size, how many tensors over it live, per granule how many of them lie in
/// its allocation, and the holds of tensors gone while the span stays (`unshare`).
struct SharedSpan {
    base: usize,
    opened: usize,
    granule: u64,
    refs: usize,
    held: Vec<u32>,
    deferred: Vec<SendHold>,
    /// Every tensor mapped through it came with a hold (what lets a block share a span that
    /// holds more than its own allocations).
    all_held: bool,
}

/// Spans of another process's allocations shared by the blocks held in them. Why: small
/// tensors pack many to a granule and a chunk holds many blocks, and each import maps its
/// allocations whole (a reservation, an import and a map each, an access grant); a block
/// whose allocations lie inside a span already mapped here costs none of it, and the
/// receiver's address space stays near what it maps. Safe because every allocation of a
/// span lies under the block that made it, whose hold keeps it, hence each of its
/// allocations, alive and at the same address in the exporter for as long as the span is
/// mapped here: a tensor that goes while others keep its span keeps its hold until the
/// span closes (else the exporter could free that block and release or reuse memory the
/// span still shows here). (An import made ahead that no rebuild took closes without its
/// hold, which stays with its send: no tensor here used it, and `covering` maps nothing
/// new through an allocation no held tensor lies in.) What a span keeps this way lies in its allocations, so it is
/// bounded by what the span maps. Without holds (the raw C route) nothing keeps the exporter's
/// blocks, so nothing says that a span's allocations are still the ones a descriptor names
/// (the exporter may have freed the block the span was made for, released its memory and
/// placed another block at the same addresses): there every block is an import of its own.
/// And a block is mapped through a span only where a tensor held here lies in each of the
/// allocations it needs (`held`).
static SHARED: std::sync::Mutex<Option<std::collections::BTreeMap<SpanKey, SharedSpan>>> = std::sync::Mutex::new(None);

/// The mapped span of `map` from the same exporter and device that holds `[origin,
/// origin + count granules)` with a held tensor in each of those granules' allocations, if
/// any, and where in it those granules start. `hold`: whether the block comes with a hold
/// (without one none serves, nor a span a tensor without one was opened through).
fn covering(map: &std::collections::BTreeMap<SpanKey, SharedSpan>, key: SpanKey, granule: u64, hold: bool) -> Option<(SpanKey, usize)> {
    let (pid, start, device, origin, count, _) = key;
    let end = origin.checked_add((count as u64).checked_mul(granule)?)?;
    map.range((pid, start, device, 0, 0, 0)..=(pid, start, device, origin, usize::MAX, u64::MAX)).rev().find_map(|(k, span)| {
        let (o, n) = (k.3, k.4);
        let first = ((origin - o.min(origin)) / granule) as usize;
        let inside = span.granule == granule && o <= origin && o + n as u64 * granule >= end && (origin - o) % granule == 0;
        let allowed = hold && span.all_held;
        (inside && allowed && span.held[first..first + count].iter().all(|&h| h > 0)).then_some((*k, first))
    })
}

/// Open `d` on `device`: a block of the arena through a span already mapped here that holds
/// all of its allocations (a granule, or chunks listed whole) where there is one (returning
/// that span's key), anything else as an import of its own. The allocations listed are
/// exactly those the block lies in, so the hold on any block mapped through them keeps them
/// all alive in the exporter.
pub fn open_shared(d: &AnyDescriptor, device: c_int, fds: &[c_int], hold: bool) -> Result<(usize, Option<SpanUse>)> {
    let AnyDescriptor::Arena(a) = d else { return Ok((d.open(device, Some(fds))?, None)) };
    static SERIAL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let key = (a.pid, a.start_time, device, a.origin, a.granules.len(), SERIAL.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    let mut shared = SHARED.lock().unwrap_or_else(|p| p.into_inner());
    let map = shared.get_or_insert_with(Default::default);
    let count = a.granules.len();
    if let Some((k, first)) = covering(map, key, a.granule, hold) {
        // What an import of its own would check (kind, descriptors), though nothing is mapped.
        registry::with_pool(device, |pool| pool.importer().check(a, fds))?;
        let g = map.get_mut(&k).expect("a covering span is in the map");
        g.refs += 1;
        g.all_held &= hold;
        g.held[first..first + count].iter_mut().for_each(|h| *h += 1);
        return Ok((g.base + (a.origin - k.3) as usize + a.offset as usize, Some((k, first, count))));
    }
    let ptr = d.open(device, Some(fds))?;
    map.insert(key, SharedSpan { base: ptr - a.offset as usize, opened: ptr, granule: a.granule, refs: 1, held: vec![1; count], deferred: Vec::new(), all_held: hold });
    Ok((ptr, Some((key, 0, count))))
}

/// A tensor's part of a span: the span's key, the first of its granules the tensor lies in
/// and how many.
pub type SpanUse = (SpanKey, usize, usize);

/// One tensor over a shared span is gone, with its hold: with the span's last, the address
/// to close and the holds to release (this one and those kept for the span); before it,
/// nothing (the hold is kept for the span, `SHARED` says why).
pub fn unshare((key, first, count): SpanUse, hold: Option<SendHold>) -> (Option<usize>, Vec<SendHold>) {
    let mut shared = SHARED.lock().unwrap_or_else(|p| p.into_inner());
    let Some(g) = shared.as_mut().and_then(|map| map.get_mut(&key)) else { return (None, hold.into_iter().collect()) };
    g.held[first..first + count].iter_mut().for_each(|h| *h -= 1);
    g.refs -= 1;
    if g.refs > 0 {
        g.deferred.extend(hold);
        return (None, Vec::new());
    }
    let g = shared.as_mut().and_then(|map| map.remove(&key)).expect("the span was just found");
    let mut holds = g.deferred;
    holds.extend(hold);
    (Some(g.opened), holds)
}

