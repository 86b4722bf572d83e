//! Which shard of a device's pool serves a stream: user streams are dealt out to the
//! device's stream shards round robin, the first time each is seen, and keep their shard
//! from then on. The legacy stream, the per-thread default stream and callers that name no
//! stream stay on shard 0.
//!
//! Why round robin and not a hash of the handle: sixteen threads on sixteen streams should
//! find sixteen locks; hashing sixteen handles into sixteen shards puts about six of them
//! on a shard another stream already uses.
//!
//! Why a fixed table of atomics: every allocation and free on a user stream asks, so a
//! lookup takes no lock and writes nothing (it reads words other threads only read). A
//! stream handle whose stream was destroyed keeps its entry: its address may come back as
//! another stream, which then shares that shard. That is only a placement: which pool holds
//! a block never depends on it (frees find the pool through `crate::owners`). Once the
//! table is full, further handles are placed by a hash. A device remade with another
//! shard count (`gpupool_configure`) keeps the placements, modulo the new count.
//!
//! Why a stream that keeps finding its shard's lock taken moves to a shard seen *idle*:
//! a recycled handle keeps the placement of the stream that had it before, so threads
//! started together (a server's workers, each creating its stream) can land on one shard,
//! and "the next shard in turn" is as likely to be another busy one (seen on the H200: 16
//! threads on 16 streams at 5.7 M pairs/s one run, 19.4 the run before). A shard whose lock
//! is free at several looks in a row has no thread working in it; the busy ones hold their
//! lock for most of each operation. The search starts at the thread's own turn
//! (`thread_turn`), so threads moving at once try different shards first.

use std::cell::Cell;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

/// Turns handed to threads whose streams moved (`thread_turn`).
static TURNS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// This thread's turn, `usize::MAX` until it first needs one.
    static TURN: Cell<usize> = const { Cell::new(usize::MAX) };
}

/// The calling thread's shard offset (`0..n`) for streams that move: its turn modulo `n`,
/// taken at first need; a new turn if that is `avoid` (the thread's own shard is the busy
/// one: another thread shares it).
fn thread_turn(n: usize, avoid: usize) -> usize {
    TURN.with(|t| {
        if t.get() == usize::MAX {
            t.set(TURNS.fetch_add(1, Ordering::Relaxed));
        }
        while n > 1 && t.get() % n == avoid {
            t.set(TURNS.fetch_add(1, Ordering::Relaxed));
        }
        t.get() % n
    })
}

/// Streams remembered per device.
const ENTRIES: usize = 256;
/// An entry's shard before its writer stored it.
const UNSET: u32 = u32::MAX;

pub struct StreamShards {
    /// Stream handles (0 = free entry; the legacy stream never enters).
    handles: [AtomicUsize; ENTRIES],
    shards: [AtomicU32; ENTRIES],
    /// Times an allocation on the entry's stream found its shard's lock taken (written only
    /// then, so a lookup's cache lines stay shared).
    strikes: [AtomicU32; ENTRIES],
    /// Streams placed so far (the next one's turn).
    placed: AtomicUsize,
}

/// Strikes after which a stream moves to the next shard in turn.
const MOVE_AFTER: u32 = 32;

#[allow(clippy::declare_interior_mutable_const)]
const FREE_HANDLE: AtomicUsize = AtomicUsize::new(0);
#[allow(clippy::declare_interior_mutable_const)]
const NO_STRIKES: AtomicU32 = AtomicU32::new(0);
#[allow(clippy::declare_interior_mutable_const)]
const UNSET_SHARD: AtomicU32 = AtomicU32::new(UNSET);

impl StreamShards {
    pub const fn new() -> Self {
        StreamShards {
            handles: [FREE_HANDLE; ENTRIES],
            shards: [UNSET_SHARD; ENTRIES],
            strikes: [NO_STRIKES; ENTRIES],
            placed: AtomicUsize::new(0),
        }
    }

    fn start(handle: usize) -> usize {
        // Stream handles are heap addresses: the low bits say little.
        (handle.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) % ENTRIES
    }

    /// The shard (`1..=n`) of the user stream `handle`, placing it if it is new. `n > 0`.
    pub fn shard_of(&self, handle: usize, n: usize) -> usize {
        let start = Self::start(handle);
        for i in 0..ENTRIES {
            let e = (start + i) % ENTRIES;
            let h = self.handles[e].load(Ordering::Acquire);
            if h == handle {
                return self.wait_for(e, n);
            }
            if h == 0 {
                match self.handles[e].compare_exchange(0, handle, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => {
                        let shard = self.placed.fetch_add(1, Ordering::AcqRel) % n;
                        self.shards[e].store(shard as u32, Ordering::Release);
                        return 1 + shard;
                    }
                    // Another thread took the entry: for this handle, or for another one.
                    Err(h) if h == handle => return self.wait_for(e, n),
                    Err(_) => continue,
                }
            }
        }
        1 + (Self::start(handle) % n)
    }

    /// The shard of a handle already placed, or `None` (nothing to look up for a stream
    /// no allocation named).
    pub fn placed(&self, handle: usize, n: usize) -> Option<usize> {
        let start = Self::start(handle);
        for i in 0..ENTRIES {
            let e = (start + i) % ENTRIES;
            match self.handles[e].load(Ordering::Acquire) {
                0 => return None,
                h if h == handle => return Some(self.wait_for(e, n)),
                _ => {}
            }
        }
        Some(1 + (Self::start(handle) % n))
    }

    /// An allocation on `handle` found its shard's lock taken. Every `MOVE_AFTER` such
    /// strikes the stream moves to the calling thread's shard (`thread_turn`; module docs
    /// say why): a stream whose handle was recycled keeps the placement of the stream that
    /// had it before, which may be a shard another busy stream now uses. A move changes
    /// only where later allocations go.
    /// `idle(k)`: whether shard `k` (`1..=n`) looks unused now.
    pub fn contended(&self, handle: usize, n: usize, idle: impl Fn(usize) -> bool) {
        let start = Self::start(handle);
        for i in 0..ENTRIES {
            let e = (start + i) % ENTRIES;
            match self.handles[e].load(Ordering::Acquire) {
                0 => return,
                h if h == handle => {
                    if self.strikes[e].fetch_add(1, Ordering::AcqRel) + 1 >= MOVE_AFTER {
                        self.strikes[e].store(0, Ordering::Release);
                        let now = self.wait_for(e, n) - 1;
                        let first = thread_turn(n, now);
                        let to = (0..n).map(|i| (first + i) % n).find(|&k| k != now && idle(1 + k)).unwrap_or(first);
                        self.shards[e].store(to as u32, Ordering::Release);
                        super::route::placements_changed();
                    }
                    return;
                }
                _ => {}
            }
        }
    }

    /// Entry `e`'s shard, once its writer (between two stores) has set it.
    fn wait_for(&self, e: usize, n: usize) -> usize {
        let mut spins = 0u32;
        loop {
            let s = self.shards[e].load(Ordering::Acquire) as usize;
            if s < n {
                return 1 + s; // no division on the common path: placements are stored below n
            }
            if s != UNSET as usize {
                return 1 + s % n; // placed under a larger shard count (the device was remade)
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_dealt_round_robin_and_keep_their_shard() {
        let t = StreamShards::new();
        let handles: Vec<usize> = (1..=32).map(|i| 0x7f00_0000_0000 + i * 0x40).collect();
        let first: Vec<usize> = handles.iter().map(|&h| t.shard_of(h, 16)).collect();
        for (i, &s) in first.iter().enumerate() {
            assert_eq!(s, 1 + i % 16, "stream {i} placed out of turn");
        }
        for (&h, &s) in handles.iter().zip(&first) {
            assert_eq!(t.shard_of(h, 16), s);
            assert_eq!(t.placed(h, 16), Some(s));
        }
        assert_eq!(t.placed(0xdead_0000, 16), None);
        // A device remade with fewer shards keeps each stream's turn, modulo the new count.
        assert_eq!(t.shard_of(handles[5], 4), 1 + 5 % 4);
    }

    #[test]
    fn a_stream_that_keeps_finding_its_shard_busy_moves_on() {
        let t = StreamShards::new();
        let (a, b) = (0x1000, 0x2000);
        assert_eq!((t.shard_of(a, 4), t.shard_of(b, 4)), (1, 2));
        let idle = |k: usize| k == 4; // shard 4 alone looks idle
        for _ in 0..MOVE_AFTER - 1 {
            t.contended(a, 4, idle);
        }
        assert_eq!(t.shard_of(a, 4), 1, "a few strikes move nothing");
        let epoch = super::super::route::placement_epoch();
        t.contended(a, 4, idle);
        assert_eq!(t.shard_of(a, 4), 4, "to the one idle shard");
        // Threads that remembered the old placement ask again (`thread_cache::route`).
        assert_ne!(super::super::route::placement_epoch(), epoch, "a move changes the placement epoch");
        assert_eq!(t.shard_of(b, 4), 2);
        for _ in 0..MOVE_AFTER {
            t.contended(b, 4, |_| false);
        }
        assert_ne!(t.shard_of(b, 4), 2, "none idle: off the busy one all the same");
        t.contended(0x3000, 4, idle); // never placed: nothing to move
        assert_eq!(t.placed(0x3000, 4), None);
    }

    #[test]
    fn threads_whose_streams_share_a_shard_end_on_different_shards() {
        // Two streams on one shard (as recycled handles can be), each used by its own thread
        // that keeps finding the lock taken: after their moves they no longer meet.
        let t = std::sync::Arc::new(StreamShards::new());
        let n = 4;
        let (a, b) = (0x7000, 0x7000 + 0x40 * n);
        assert_eq!(t.shard_of(a, n), 1);
        for i in 1..n {
            t.shard_of(0x9000 + i * 0x40, n); // the next streams in turn
        }
        assert_eq!(t.shard_of(b, n), 1, "b shares a's shard");
        let strike = |h: usize| {
            let t = t.clone();
            std::thread::spawn(move || {
                for _ in 0..MOVE_AFTER {
                    t.contended(h, n, |_| false); // nothing looks idle: the threads' turns decide
                }
            })
            .join()
            .unwrap()
        };
        for _ in 0..8 {
            if t.shard_of(a, n) != t.shard_of(b, n) {
                break;
            }
            strike(a);
            strike(b);
        }
        assert_ne!(t.shard_of(a, n), t.shard_of(b, n));
    }

    #[test]
    fn a_full_table_still_places_every_stream_in_range() {
        let t = StreamShards::new();
        for h in 1..=(3 * ENTRIES) {
            let s = t.shard_of(h * 256, 5);
            assert!((1..=5).contains(&s));
            assert_eq!(t.shard_of(h * 256, 5), s, "handle {h} moved");
        }
    }

    #[test]
    fn threads_racing_to_place_one_stream_agree() {
        let t = std::sync::Arc::new(StreamShards::new());
        let got: Vec<usize> = (0..8)
            .map(|_| {
                let t = t.clone();
                std::thread::spawn(move || t.shard_of(0x5000, 4))
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|j| j.join().unwrap())
            .collect();
        assert!(got.iter().all(|&s| s == got[0]), "{got:?}");
    }
}
