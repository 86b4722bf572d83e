//! Whether a device's shards make driver calls for growth at the same time.
//!
//! The driver runs virtual-memory calls (`cuMemMap`, `cuMemSetAccess`, `cuMemCreate`) one
//! at a time for the whole process, and slower under contention than one after the other:
//! a map that takes a microsecond or two alone waits half a millisecond on average when
//! sixteen threads stitch at once, an access grant over four granules goes from about 0.1
//! to 0.85 ms (`docs/arena.md`, "Buffers that grow by reallocation"). A stitch saves memory
//! at the price of such calls, which is a good trade while one thread makes them and a bad
//! one when several shards wait on each other. Every shard's growth that makes driver calls
//! passes through `begin`; one that begins while another is under way marks the device
//! contended for `WINDOW_NS`, during which the arena serves small requests with new memory
//! instead of new stitches (`ArenaStrategy::set_small_stitches`), which stop once the
//! memory suffices.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

/// How long one overlap of two shards' growths keeps the device contended.
pub const WINDOW_NS: u64 = 200_000_000;

#[derive(Debug, Default)]
pub struct DriverContention {
    /// Growths making driver calls right now, over every shard of the device.
    in_flight: AtomicUsize,
    /// When (`now_ns`) a growth last began while another was under way; 0: never.
    contended_at: AtomicU64,
}

/// A growth under way (`DriverContention::begin`); ends when dropped.
pub struct InFlight<'a>(&'a DriverContention);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Nanoseconds since the process first asked, never 0.
fn now_ns() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64 + 1
}

impl DriverContention {
    /// A growth that is about to make driver calls; hold the result while it does.
    pub fn begin(&self) -> InFlight<'_> {
        if self.in_flight.fetch_add(1, Ordering::AcqRel) > 0 {
            self.contended_at.store(now_ns(), Ordering::Release);
        }
        InFlight(self)
    }

    /// Whether two growths overlapped within the last `WINDOW_NS`.
    pub fn contended(&self) -> bool {
        self.contended_as_of(now_ns())
    }

    fn contended_as_of(&self, now: u64) -> bool {
        let at = self.contended_at.load(Ordering::Acquire);
        at != 0 && now.saturating_sub(at) < WINDOW_NS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_overlapping_growths_mark_the_device_contended() {
        let c = DriverContention::default();
        drop(c.begin());
        drop(c.begin());
        assert!(!c.contended(), "growths one after another do not contend");
        let first = c.begin();
        assert!(!c.contended());
        let second = c.begin();
        assert!(c.contended(), "a growth that began while another was under way");
        drop((first, second));
        assert!(c.contended(), "the mark lasts its window");
        assert_eq!(c.in_flight.load(Ordering::Acquire), 0);
    }

    #[test]
    fn the_mark_expires_after_its_window() {
        let c = DriverContention::default();
        assert!(!c.contended_as_of(5), "never marked");
        c.contended_at.store(1_000, Ordering::Release);
        assert!(c.contended_as_of(1_000 + WINDOW_NS - 1));
        assert!(!c.contended_as_of(1_000 + WINDOW_NS));
    }
}
