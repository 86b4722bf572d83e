//! Whether a device's shards make driver calls for growth at the same time.
//!
//! The driver runs virtual-memory calls (`cuMemMap`, `cuMemSetAccess`, `cuMemCreate`) one
//! at a time for the whole process, and each waits far longer when several threads make
//! them at once than alone (`docs/arena.md`, "Buffers that grow by reallocation", has the
//! measurements). A stitch saves memory at the price of such calls: a good trade while one
//! thread makes them, a bad one when shards wait on each other. The arena's growths that
//! map memory (a stitch, a window over unmapped granules) pass through `begin`; one that
//! begins while another is under way marks the device contended for `WINDOW_NS`. Meanwhile
//! the arena serves small requests with new memory instead of new stitches
//! (`PlanRules::small_stitches`): new memory is needed only until there is enough,
//! where stitches go on as long as the pattern does. One thread's growths never overlap,
//! so a single-threaded program never sees the device contended. The count is per device,
//! while the driver serialises the whole process: growths on two devices do not count as
//! overlapping.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

/// How long one overlap of two shards' growths keeps the device contended: long enough to
/// span a burst of growths, short enough that shards that stop growing together go back
/// to stitching soon.
pub const WINDOW_NS: u64 = 200_000_000;

#[derive(Debug, Default)]
pub struct DriverContention {
    /// Growths making driver calls right now, over every shard of the device.
    in_flight: AtomicUsize,
    /// When (`now_ns`) a growth last began while another was under way; 0: never.
    contended_at: AtomicU64,
}

/// A growth under way (`DriverContention::begin`); ends when dropped.
#[must_use = "the growth ends when this is dropped"]
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
    #[must_use = "the growth ends when the result is dropped"]
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
        assert_eq!(c.contended_at.load(Ordering::Acquire), 0, "growths one after another do not contend");
        let first = c.begin();
        assert_eq!(c.contended_at.load(Ordering::Acquire), 0);
        let second = c.begin();
        let at = c.contended_at.load(Ordering::Acquire);
        assert_ne!(at, 0, "a growth that began while another was under way marks the device");
        assert!(c.contended_as_of(at) && c.contended_as_of(at + WINDOW_NS - 1));
        drop((first, second));
        assert_eq!(c.in_flight.load(Ordering::Acquire), 0, "both growths ended");
        drop(c.begin());
        assert_eq!(c.contended_at.load(Ordering::Acquire), at, "a growth alone leaves the mark as it was");
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
