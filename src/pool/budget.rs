//! A device's memory budget: the bytes its pools have reserved from the driver, the peak
//! of that figure, and the limit on it. Every shard of a device's pool (`crate::registry`)
//! holds the same `Budget` in its limit layer (`limits.rs`), so the limit caps the device,
//! not each shard. It also carries what else the shards share of the device: whether their
//! growths' driver calls contend (`contention.rs`), and how many routes to private pools
//! are active in any of them (Note [Graph pools under a tag]).
//!
//! Why atomics and not a lock: the budget changes only when memory comes from or goes back
//! to the upstream (a driver call anyway), never on a cached allocation, so its cache line
//! is not fought over on the hot path. A growth claims its bytes before asking the
//! upstream (`claim`) and gives them back if the upstream refuses (`unclaim`): two shards
//! growing at once cannot together pass the limit.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

#[derive(Debug, Default)]
pub struct Budget {
    reserved: AtomicUsize,
    peak: AtomicUsize,
    /// Reserved-bytes cap; 0 = none.
    limit: AtomicUsize,
    /// Whether the configured limit was set (by the first pool made for the device):
    /// a shard made later must not undo `gpupool_set_limit`.
    limit_initialised: AtomicBool,
    contention: super::contention::DriverContention,
    /// Routes to private pools active in the device's pools.
    routes: AtomicUsize,
}

impl Budget {
    /// A route began in one of the device's pools.
    pub fn route_began(&self) {
        self.routes.fetch_add(1, Ordering::AcqRel);
    }

    /// `n` routes of the device's pools ended.
    pub fn routes_ended(&self, n: usize) {
        let _ = self.routes.fetch_update(Ordering::AcqRel, Ordering::Acquire, |r| Some(r.saturating_sub(n)));
    }

    /// Whether a route is active in any of the device's pools: a capture may run, so each
    /// of them behaves as one may (no device-wide wait; frees ask whether their stream
    /// captures).
    pub fn routes_active(&self) -> bool {
        self.routes.load(Ordering::Acquire) != 0
    }

    /// Set the configured limit, once per device: later calls (later shards) leave it.
    pub fn init_limit(&self, bytes: usize) {
        if !self.limit_initialised.swap(true, Ordering::AcqRel) {
            self.limit.store(bytes, Ordering::Release);
        }
    }

    pub fn set_limit(&self, bytes: usize) {
        self.limit_initialised.store(true, Ordering::Release);
        self.limit.store(bytes, Ordering::Release);
    }

    pub fn limit(&self) -> usize {
        self.limit.load(Ordering::Acquire)
    }

    /// Whether the device's shards grow at the same time (`contention.rs`).
    pub fn contention(&self) -> &super::contention::DriverContention {
        &self.contention
    }

    /// Bytes reserved by every pool of the device.
    pub fn reserved(&self) -> usize {
        self.reserved.load(Ordering::Acquire)
    }

    /// The highest `reserved` reached.
    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::Acquire)
    }

    /// Start the peak again from what is reserved now (`gpupool_reset_peak_stats`).
    pub fn reset_peak(&self) {
        self.peak.store(self.reserved(), Ordering::Release);
    }

    /// Reserved bytes above the limit (0 without a limit or below it).
    pub fn excess(&self) -> usize {
        match self.limit() {
            0 => 0,
            l => self.reserved().saturating_sub(l),
        }
    }

    /// Book `bytes` about to be reserved, if the limit allows them. On success the caller
    /// either gets the memory (`confirm`) or gives the claim back (`unclaim`).
    pub fn claim(&self, bytes: usize) -> bool {
        let mut now = self.reserved.load(Ordering::Acquire);
        loop {
            let limit = self.limit();
            if limit != 0 && bytes > limit.saturating_sub(now) {
                return false;
            }
            match self.reserved.compare_exchange_weak(now, now + bytes, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(seen) => now = seen,
            }
        }
    }

    /// A claim whose memory the upstream did not give.
    pub fn unclaim(&self, bytes: usize) {
        self.reserved.fetch_sub(bytes, Ordering::AcqRel);
    }

    /// A claim whose memory arrived: the peak may move.
    pub fn confirm(&self) {
        self.peak.fetch_max(self.reserved(), Ordering::AcqRel);
    }

    /// `bytes` went back to the upstream.
    pub fn released(&self, bytes: usize) {
        self.reserved.fetch_sub(bytes, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_respect_the_limit_and_the_peak_follows_confirmed_ones() {
        let b = Budget::default();
        b.init_limit(100);
        b.init_limit(7); // a later shard: ignored
        assert_eq!(b.limit(), 100);
        assert!(b.claim(60));
        b.confirm();
        assert!(!b.claim(41), "60 + 41 passes the limit of 100");
        assert!(b.claim(40));
        b.unclaim(40); // the upstream refused
        assert_eq!((b.reserved(), b.peak()), (60, 60));
        b.released(60);
        assert_eq!((b.reserved(), b.peak()), (0, 60));
        b.set_limit(0);
        assert!(b.claim(1 << 40), "no limit");
        assert_eq!(b.excess(), 0);
        b.set_limit(10);
        assert_eq!(b.excess(), (1 << 40) - 10);
    }
}
