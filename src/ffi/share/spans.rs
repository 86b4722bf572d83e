//! Spans of another process's allocations mapped here once for every block in them this
//! process holds (`gpupool_ipc_open_dlpack`'s imports).
//!
//! Why: small tensors pack many to a granule, a chunk holds many blocks, and blocks sent one
//! after another share the allocation at their boundary; each import maps its allocations
//! whole (a reservation, an import and a map each, and an access grant, which the driver
//! charges per allocation). A block whose allocations lie inside a span already mapped here
//! costs none of it; a block that starts inside a span and runs past its end extends the
//! span in place, importing only the allocations past the end; and the receiver's address
//! space stays what it maps.
//!
//! Safe because every allocation of a span lies under a block mapped through it whose hold
//! keeps that block, hence each of its allocations, alive and at the same address in the
//! exporter for as long as the span is mapped here: a tensor that goes while others keep
//! its span keeps its hold until the span closes (else the exporter could free that block
//! and release or reuse memory the span still shows here). What a span keeps this way lies
//! in its allocations, so it is bounded by what the span maps. Without holds (the raw C
//! route) nothing keeps the exporter's blocks: there a block shares only a span of exactly
//! its own allocations, whose mapping goes with the last tensor over them, and no span is
//! extended. A block is mapped through (or extends) a span only where a tensor held here
//! lies in each of the span's allocations it needs (`held`): those are the exporter's
//! allocations at those addresses now.

use crate::error::Result;
use crate::registry;
use crate::upstream::shared::Descriptor;
use std::collections::BTreeMap;
use std::ffi::c_int;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// An exporter's mapped span: its pid, start time, device, the address of its first
/// granule there, and a number of its own (a span can be mapped again while the first
/// mapping lives, see `covering`).
type SpanKey = (u32, u64, i32, u64, u64);

/// An exporter's hold on one of its blocks (`holds`): its holds file and slot.
pub type Hold = ((u64, u64), u32);

/// A tensor's part of a span: the span's key, the first of its granules the tensor lies in
/// and how many.
pub type SpanUse = (SpanKey, usize, usize);

/// One span: where it starts here, the addresses its imports returned (the first, then one
/// per extension: what closes it), its granule size and count, how many tensors over it
/// live, per granule how many of them lie in its allocation, and the holds of tensors gone
/// while the span stays (`unshare`).
struct SharedSpan {
    base: usize,
    opened: Vec<usize>,
    granule: u64,
    count: usize,
    refs: usize,
    held: Vec<u32>,
    deferred: Vec<Hold>,
    /// Every tensor mapped through it came with a hold (what lets a block share a span that
    /// holds more than its own allocations).
    all_held: bool,
}

static SHARED: Mutex<Option<BTreeMap<SpanKey, SharedSpan>>> = Mutex::new(None);

/// The spans of `map` from the exporter and device of `key` whose first granule is at or
/// below `origin` there, highest first.
fn below(map: &BTreeMap<SpanKey, SharedSpan>, key: SpanKey) -> impl Iterator<Item = (&SpanKey, &SharedSpan)> {
    let (pid, start, device, origin, _) = key;
    map.range((pid, start, device, 0, 0)..=(pid, start, device, origin, u64::MAX)).rev()
}

/// The mapped span that holds `[origin, origin + count granules)` with a held tensor in
/// each of those granules' allocations, if any, and where in it those granules start.
/// `hold`: whether the block comes with a hold (without one, or where a tensor of the span
/// came without one, only a span of exactly those granules).
fn covering(map: &BTreeMap<SpanKey, SharedSpan>, key: SpanKey, count: usize, granule: u64, hold: bool) -> Option<(SpanKey, usize)> {
    let origin = key.3;
    let end = origin.checked_add((count as u64).checked_mul(granule)?)?;
    below(map, key).find_map(|(k, span)| {
        let (o, n) = (k.3, span.count);
        let first = ((origin - o) / granule) as usize;
        let inside = span.granule == granule && o + n as u64 * granule >= end && (origin - o) % granule == 0;
        let allowed = (hold && span.all_held) || (o == origin && n == count);
        (inside && allowed && span.held[first..first + count].iter().all(|&h| h > 0)).then_some((*k, first))
    })
}

/// The mapped span, every tensor over it held, in which `[origin, origin + count granules)`
/// starts and past whose end it runs, with a held tensor in each allocation from `origin` to
/// that end: the span, where in it the block starts, and how many of the block's granules
/// it already maps.
fn extendable(map: &BTreeMap<SpanKey, SharedSpan>, key: SpanKey, count: usize, granule: u64) -> Option<(SpanKey, usize, usize)> {
    let origin = key.3;
    below(map, key).find_map(|(k, span)| {
        let (o, n) = (k.3, span.count);
        let first = ((origin - o) / granule) as usize;
        let fits = span.granule == granule && span.all_held && (origin - o) % granule == 0 && first < n && first + count > n;
        (fits && span.held[first..].iter().all(|&h| h > 0)).then_some((*k, first, n - first))
    })
}

/// Open `d` (an arena block's descriptor, with this process's copies `fds` of its
/// descriptors) on `device`: through a span already mapped here that holds all of its
/// allocations (a granule, or chunks listed whole), by extending a span it starts in, or
/// as an import of its own, which becomes a span. Returns the block's address and its part
/// of the span. The allocations listed are exactly those the block lies in, so the hold on
/// any block mapped through them keeps them all alive in the exporter.
pub fn open_shared(a: &Descriptor, device: c_int, fds: &[c_int], hold: bool) -> Result<(usize, SpanUse)> {
    static SERIAL: AtomicU64 = AtomicU64::new(0);
    let key = (a.pid, a.start_time, device, a.origin, SERIAL.fetch_add(1, Ordering::Relaxed));
    let mut shared = SHARED.lock().unwrap_or_else(|p| p.into_inner());
    let map = shared.get_or_insert_with(Default::default);
    let count = a.granules.len();
    let g = a.granule as usize;
    if let Some((k, first)) = covering(map, key, count, a.granule, hold) {
        // What an import of its own would check (kind, descriptors), though nothing is mapped.
        registry::with_pool(device, |pool| pool.ipc_check(a, fds))?;
        let span = map.get_mut(&k).expect("a covering span is in the map");
        span.refs += 1;
        span.all_held &= hold;
        span.held[first..first + count].iter_mut().for_each(|h| *h += 1);
        return Ok((span.base + (a.origin - k.3) as usize + a.offset as usize, (k, first, count)));
    }
    if hold {
        // (The upstream refuses a tail that starts inside an allocation, as any import that
        // lists an allocation from its middle, before mapping anything.)
        if let Some((k, first, inside)) = extendable(map, key, count, a.granule) {
            registry::with_pool(device, |pool| pool.ipc_check(a, fds))?;
            let span = map.get_mut(&k).expect("an extendable span is in the map");
            let at = span.base + span.count * g;
            let tail = Descriptor {
                granules: a.granules[inside..].to_vec(),
                origin: a.origin + (inside * g) as u64,
                offset: 0,
                size: ((count - inside) * g) as u64,
                ..a.clone()
            };
            // Where the address space past the span is taken, the block is imported on its own.
            if let Ok(p) = registry::with_pool(device, |pool| pool.ipc_import_at(&tail, &fds[inside..], at)) {
                debug_assert_eq!(p, at);
                span.opened.push(at);
                span.count += count - inside;
                span.held[first..].iter_mut().for_each(|h| *h += 1);
                span.held.resize(span.count, 1);
                span.refs += 1;
                return Ok((span.base + (a.origin - k.3) as usize + a.offset as usize, (k, first, count)));
            }
        }
    }
    let ptr = registry::with_pool(device, |pool| pool.ipc_import(a, Some(fds)))?;
    let base = ptr - a.offset as usize;
    map.insert(key, SharedSpan { base, opened: vec![ptr], granule: a.granule, count, refs: 1, held: vec![1; count], deferred: Vec::new(), all_held: hold });
    Ok((ptr, (key, 0, count)))
}

/// One tensor over a shared span is gone, with its hold: with the span's last, the
/// addresses to close and the holds to release (this one and those kept for the span);
/// before it, nothing (the hold is kept for the span, the module's comment says why).
pub fn unshare((key, first, count): SpanUse, hold: Option<Hold>) -> (Vec<usize>, Vec<Hold>) {
    let mut shared = SHARED.lock().unwrap_or_else(|p| p.into_inner());
    let Some(span) = shared.as_mut().and_then(|map| map.get_mut(&key)) else { return (Vec::new(), hold.into_iter().collect()) };
    span.held[first..first + count].iter_mut().for_each(|h| *h -= 1);
    span.refs -= 1;
    if span.refs > 0 {
        span.deferred.extend(hold);
        return (Vec::new(), Vec::new());
    }
    let span = shared.as_mut().and_then(|map| map.remove(&key)).expect("the span was just found");
    let mut holds = span.deferred;
    holds.extend(hold);
    (span.opened, holds)
}
