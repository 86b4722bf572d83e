//! Routes to private pools announced on each device (CUDA graph captures, `MemPool`
//! scopes: `crate::pool`'s routes). A device's route may live in any of its pools (shard 0,
//! or a tag's pool: Note [Graph pools under a tag]), and while any is active the driver
//! calls of every upstream of that device run in relaxed capture mode, so that a pool
//! without the route does not invalidate a capture in global mode. (What else a capture
//! forbids the pools count in their shared `Budget`.)

use std::sync::atomic::{AtomicUsize, Ordering};

/// Devices counted apart; a higher ordinal shares the last counter (never too few).
const DEVICES: usize = 64;

static ACTIVE: [AtomicUsize; DEVICES] = [const { AtomicUsize::new(0) }; DEVICES];

fn counter(device: i32) -> &'static AtomicUsize {
    &ACTIVE[(device.max(0) as usize).min(DEVICES - 1)]
}

/// A route began on `device`.
pub fn began(device: i32) {
    counter(device).fetch_add(1, Ordering::AcqRel);
}

/// `n` routes of `device` ended (or went with their pool).
pub fn ended(device: i32, n: usize) {
    let _ = counter(device).fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| Some(c.saturating_sub(n)));
}

/// Whether any route is active on `device`.
pub fn active(device: i32) -> bool {
    counter(device).load(Ordering::Acquire) != 0
}
