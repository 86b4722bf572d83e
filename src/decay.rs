//! Cache decay: gives back cached memory that the recent past did not need.
//!
//! A caching pool that keeps everything it ever reserved holds the all-time peak forever:
//! after a spike, or in a workload whose live set wanders (random churn), device memory
//! stays at the peak while far less is live (PyTorch's and CuPy's pools do the same). Here the pool remembers the highest
//! in-use figure of the last `window` allocations (a ring of per-epoch maxima: one compare
//! per allocation, a short scan per epoch) and, once per epoch, releases wholly free
//! segments until reserved memory is at most that recent peak plus a headroom.
//!
//! Off by default (`DEFAULT_WINDOW`): each release can synchronise the device.
//!
//! A loop that reuses the same memory every iteration keeps its peak inside the window and
//! never sees a release; only memory idle for a whole window goes back (the idea of
//! jemalloc's decay and the driver pool's release threshold, counted in allocations rather
//! than seconds so a replay of a trace behaves like the run that recorded it).

/// Epochs in the window; the window is `EPOCHS` x the epoch length.
const EPOCHS: usize = 8;

/// Default window (`GPUPOOL_DECAY`): 0, decay off. Every release of `cuMemAlloc` memory is a
/// `cuMemFree`, which synchronises the whole device; a pool that releases on its own would
/// insert device-wide stalls into GPU-bound programs whose live set wanders (dynamic shapes),
/// which is why PyTorch's allocator never frees in steady state. Decay is for programs whose
/// limit is memory. `gpupool-replay --decay N` shows what a window trades on a trace:
/// memory held against segment allocations.
pub const DEFAULT_WINDOW: usize = 0;

/// Headroom above the recent peak, in 1/64ths (2/64 = 3.1 %): room for fragmentation and
/// for the next allocations, so the pool does not release what it must re-reserve at once.
const HEADROOM_64THS: usize = 2;

#[derive(Clone, Debug)]
pub struct Decay {
    epoch_len: u32,
    count: u32,
    epoch_max: usize,
    ring: [usize; EPOCHS],
    pos: usize,
}

impl Decay {
    /// `window`: allocations a cached byte may sit unneeded before it goes back; 0 = never.
    pub fn new(window: usize) -> Option<Decay> {
        if window == 0 {
            return None;
        }
        let epoch_len = (window / EPOCHS).clamp(1, u32::MAX as usize) as u32;
        Some(Decay { epoch_len, count: 0, epoch_max: 0, ring: [0; EPOCHS], pos: 0 })
    }

    /// Note an allocation that left `used` bytes in use. Once per epoch returns the most
    /// memory the pool should keep reserved.
    #[inline]
    pub fn on_malloc(&mut self, used: usize) -> Option<usize> {
        self.epoch_max = self.epoch_max.max(used);
        self.count += 1;
        if self.count < self.epoch_len {
            return None;
        }
        self.count = 0;
        self.ring[self.pos] = self.epoch_max;
        self.pos = (self.pos + 1) % EPOCHS;
        self.epoch_max = used;
        Some(self.cap(used))
    }

    /// The most memory worth keeping reserved now, with `used` bytes in use: the peak of
    /// the window (this epoch included) plus the headroom.
    pub fn cap(&self, used: usize) -> usize {
        let recent_peak = self.ring.iter().copied().max().unwrap_or(0).max(self.epoch_max).max(used);
        recent_peak + recent_peak / 64 * HEADROOM_64THS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_peak_of_the_window_then_lets_it_go() {
        let mut d = Decay::new(80).unwrap(); // epochs of 10 allocations
        let mut caps = Vec::new();
        for i in 0..200 {
            let used = if i == 5 { 1000 } else { 100 };
            if let Some(cap) = d.on_malloc(used) {
                caps.push(cap);
            }
        }
        assert_eq!(caps.len(), 20);
        // The spike is remembered for 8 epochs, then only the steady 100 remains.
        assert!(caps[..8].iter().all(|&c| c >= 1000), "{caps:?}");
        assert!(caps[8..].iter().all(|&c| (100..=110).contains(&c)), "{caps:?}");
    }

    #[test]
    fn zero_window_disables() {
        assert!(Decay::new(0).is_none());
    }
}
