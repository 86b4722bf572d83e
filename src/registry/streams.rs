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
//! Why streams move, and when. A placement can go stale: a destroyed stream keeps its entry,
//! so a recycled handle keeps the old stream's shard, and the round-robin turn goes on from
//! wherever earlier streams left it. Threads started together (a server's workers, each
//! creating its stream) can so find two live streams on one shard and another shard unused.
//! Two streams sharing a shard cost far more than a lock: each is refused the other's blocks
//! still pending on the other stream, the shard grows with driver calls, and blocks move
//! across streams with event queries (seen on the H200: 308 and 550 `cuMemAlloc` calls and
//! thousands of cross-stream reuses in a 16-thread row that a clean placement runs with 17
//! and none). Most of the time those threads never meet on the lock (their thread caches take
//! none), so a lock found taken is too rare a sign. The sign used is the shard's *last
//! allocating stream*: every locked allocation on a stream shard notes its stream there
//! (`allocating`), and one that finds another stream noted strikes against its placement,
//! as does one that finds the lock taken. A shard one stream uses is written only by that
//! stream's thread, so the note costs no shared cache line.
//!
//! Where a stream moves: to a shard that made no locked allocation at all while the stream
//! gathered its last `MOVE_AFTER / 2` strikes, over at least `IDLE_WINDOW` (counts taken at
//! the halfway strike, kept by the striking thread, compared at the last). A shard busy in
//! that window has a live stream of its own; with none idle (more live streams than
//! shards) the stream stays: moving would only make another pair share. Movers claim their
//! shard (its last-stream note) so two streams moving at once do not pick the same one. The
//! search starts at the thread's own turn (`thread_turn`), so threads moving at once try
//! different shards first.

use super::SHARDS;
use std::cell::Cell;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Turns handed to threads whose streams moved (`thread_turn`).
static TURNS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// This thread's turn, `usize::MAX` until it first needs one.
    static TURN: Cell<usize> = const { Cell::new(usize::MAX) };
    /// The shards' allocation counts when this thread's stream reached half its strikes.
    static SEEN: Cell<Option<Seen>> = const { Cell::new(None) };
}

/// What a thread saw at a stream's halfway strike (`StreamShards::strike`).
#[derive(Copy, Clone)]
struct Seen {
    /// The table (its address) and entry the counts were taken for.
    table: usize,
    entry: usize,
    at: Instant,
    allocs: [u32; SHARDS],
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

/// What a shard's lock holder notes about the shard's use (`allocating`), on a cache line
/// of its own: written only under the shard's lock, read only by streams about to move.
#[repr(align(128))]
struct Activity {
    /// The stream of the shard's last locked allocation (0: none yet).
    last_stream: AtomicUsize,
    /// Locked allocations on user streams, wrapping.
    allocs: AtomicU32,
}

pub struct StreamShards {
    /// Stream handles (0 = free entry; the legacy stream never enters).
    handles: [AtomicUsize; ENTRIES],
    shards: [AtomicU32; ENTRIES],
    /// Times an allocation on the entry's stream found its shard's lock taken (written only
    /// then, so a lookup's cache lines stay shared).
    strikes: [AtomicU32; ENTRIES],
    /// Streams placed so far (the next one's turn).
    placed: AtomicUsize,
    /// Per shard (index as in the registry: 1..=n are stream shards).
    activity: [Activity; SHARDS],
}

/// Strikes after which a stream moves to a shard seen idle (module docs).
const MOVE_AFTER: u32 = 32;
/// The shortest time a shard must make no locked allocation to be seen idle: a live
/// stream's thread may go this long on its thread cache alone, not much longer (its cache
/// holds a few blocks; a workload that never misses it never allocates under the lock).
const IDLE_WINDOW: Duration = Duration::from_millis(2);

#[allow(clippy::declare_interior_mutable_const)]
const FREE_HANDLE: AtomicUsize = AtomicUsize::new(0);
#[allow(clippy::declare_interior_mutable_const)]
const NO_STRIKES: AtomicU32 = AtomicU32::new(0);
#[allow(clippy::declare_interior_mutable_const)]
const UNSET_SHARD: AtomicU32 = AtomicU32::new(UNSET);
#[allow(clippy::declare_interior_mutable_const)]
const UNUSED: Activity = Activity { last_stream: AtomicUsize::new(0), allocs: AtomicU32::new(0) };

impl StreamShards {
    pub const fn new() -> Self {
        StreamShards {
            handles: [FREE_HANDLE; ENTRIES],
            shards: [UNSET_SHARD; ENTRIES],
            strikes: [NO_STRIKES; ENTRIES],
            placed: AtomicUsize::new(0),
            activity: [UNUSED; SHARDS],
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

    /// An allocation on `handle` holds the lock of its shard `k` (`1..=n`): note it, and
    /// strike against the placement if another stream allocated there last.
    pub fn allocating(&self, handle: usize, k: usize, n: usize) {
        let a = &self.activity[k];
        // Only the lock holder writes these, so plain load-then-store is exact.
        a.allocs.store(a.allocs.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
        let last = a.last_stream.load(Ordering::Relaxed);
        if last != handle {
            a.last_stream.store(handle, Ordering::Relaxed);
            if last != 0 {
                self.strike(handle, n);
            }
        }
    }

    /// An allocation on `handle` found its shard's lock taken: a strike.
    pub fn contended(&self, handle: usize, n: usize) {
        self.strike(handle, n);
    }

    /// One strike against `handle`'s placement; at `MOVE_AFTER` the stream moves to a shard
    /// seen idle since its halfway strike, if one is (module docs). A move changes only
    /// where later allocations go.
    fn strike(&self, handle: usize, n: usize) {
        let Some(e) = self.entry(handle) else { return };
        let struck = self.strikes[e].fetch_add(1, Ordering::AcqRel) + 1;
        if struck == MOVE_AFTER / 2 {
            self.remember_counts(e);
            return;
        }
        if struck < MOVE_AFTER {
            return;
        }
        let seen = SEEN.with(|c| c.get()).filter(|s| s.table == self as *const _ as usize && s.entry == e);
        let Some(seen) = seen else {
            // Another thread took the halfway counts (or this one's are for another
            // stream): start the window here.
            self.remember_counts(e);
            self.strikes[e].store(MOVE_AFTER / 2, Ordering::Release);
            return;
        };
        if seen.at.elapsed() < IDLE_WINDOW {
            self.strikes[e].store(MOVE_AFTER - 1, Ordering::Release); // judge at the next strike
            return;
        }
        self.strikes[e].store(0, Ordering::Release);
        SEEN.with(|c| c.set(None));
        let now = self.wait_for(e, n) - 1;
        let first = thread_turn(n, now);
        for k in (0..n).map(|i| (first + i) % n).filter(|&k| k != now) {
            let a = &self.activity[1 + k];
            if a.allocs.load(Ordering::Acquire) != seen.allocs[1 + k] {
                continue; // busy in the window
            }
            let last = a.last_stream.load(Ordering::Acquire);
            // Claim it: a stream moving at the same time finds the note changed.
            if a.last_stream.compare_exchange(last, handle, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                self.shards[e].store(k as u32, Ordering::Release);
                super::route::placements_changed();
                return;
            }
        }
    }

    /// Keep, for this thread, every shard's allocation count now (entry `e`'s halfway strike).
    fn remember_counts(&self, e: usize) {
        let mut allocs = [0u32; SHARDS];
        for (c, a) in allocs.iter_mut().zip(&self.activity) {
            *c = a.allocs.load(Ordering::Acquire);
        }
        let seen = Seen { table: self as *const _ as usize, entry: e, at: Instant::now(), allocs };
        SEEN.with(|c| c.set(Some(seen)));
    }

    /// The entry of a placed handle.
    fn entry(&self, handle: usize) -> Option<usize> {
        let start = Self::start(handle);
        for i in 0..ENTRIES {
            let e = (start + i) % ENTRIES;
            match self.handles[e].load(Ordering::Acquire) {
                0 => return None,
                h if h == handle => return Some(e),
                _ => {}
            }
        }
        None
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
    use std::sync::Arc;

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

    /// Shard `k`'s lock held while `allocating` runs, as the registry holds it.
    fn alloc_on(t: &StreamShards, locks: &[std::sync::Mutex<()>], h: usize, n: usize) -> usize {
        let k = t.shard_of(h, n);
        let _g = locks[k].lock().unwrap();
        t.allocating(h, k, n);
        k
    }

    fn locks() -> Vec<std::sync::Mutex<()>> {
        (0..SHARDS).map(|_| std::sync::Mutex::new(())).collect()
    }

    #[test]
    fn a_stream_that_keeps_finding_its_shard_busy_moves_to_an_idle_one() {
        let (t, l, n) = (StreamShards::new(), locks(), 4);
        let (a, b, c) = (0x1000, 0x2000, 0x3000);
        assert_eq!((t.shard_of(a, n), t.shard_of(b, n), t.shard_of(c, n)), (1, 2, 3));
        for _ in 0..MOVE_AFTER / 2 {
            t.contended(a, n); // the halfway strike takes the shards' counts
        }
        alloc_on(&t, &l, b, n); // shards 2 and 3 work in the window; 4 does not
        alloc_on(&t, &l, c, n);
        std::thread::sleep(IDLE_WINDOW);
        for _ in 0..MOVE_AFTER / 2 - 1 {
            t.contended(a, n);
        }
        assert_eq!(t.shard_of(a, n), 1, "fewer strikes move nothing");
        let epoch = super::super::route::placement_epoch();
        t.contended(a, n);
        assert_eq!(t.shard_of(a, n), 4, "to the one idle shard");
        // Threads that remembered the old placement ask again (`thread_cache::route`).
        assert_ne!(super::super::route::placement_epoch(), epoch, "a move changes the placement epoch");
        assert_eq!((t.shard_of(b, n), t.shard_of(c, n)), (2, 3));
        t.contended(0x9000, n); // never placed: nothing to move
        assert_eq!(t.placed(0x9000, n), None);
    }

    #[test]
    fn a_stream_stays_when_every_other_shard_is_busy() {
        let (t, l, n) = (StreamShards::new(), locks(), 3);
        let (a, b, c) = (0x1000, 0x2000, 0x3000);
        assert_eq!((t.shard_of(a, n), t.shard_of(b, n), t.shard_of(c, n)), (1, 2, 3));
        for round in 0..3 {
            for i in 0..MOVE_AFTER {
                if i == MOVE_AFTER / 2 {
                    alloc_on(&t, &l, b, n);
                    alloc_on(&t, &l, c, n);
                    std::thread::sleep(IDLE_WINDOW);
                }
                t.contended(a, n);
            }
            assert_eq!(t.shard_of(a, n), 1, "round {round}: moving would make another pair share");
        }
    }

    #[test]
    fn a_stream_on_a_dead_streams_shard_does_not_move() {
        // A destroyed stream's note stays on its shard: the next stream there strikes once.
        let (t, l, n) = (StreamShards::new(), locks(), 2);
        let (dead, h) = (0x1000, 0x2000 + 0x40);
        alloc_on(&t, &l, dead, n);
        t.shard_of(0x5000, n); // the next turn: shard 2
        assert_eq!(t.shard_of(h, n), 1, "h is dealt the dead stream's shard");
        for _ in 0..10 * MOVE_AFTER {
            assert_eq!(alloc_on(&t, &l, h, n), 1);
        }
        std::thread::sleep(IDLE_WINDOW);
        for _ in 0..10 * MOVE_AFTER {
            assert_eq!(alloc_on(&t, &l, h, n), 1);
        }
    }

    #[test]
    fn two_live_streams_on_one_shard_move_apart_and_leave_busy_shards_alone() {
        // As in threads_bench's 16-thread rows: a recycled handle keeps an earlier stream's
        // shard, so two working streams share shard 1 while shard 3 has no stream at all.
        let (t, l, n) = (Arc::new(StreamShards::new()), Arc::new(locks()), 3);
        let (a, busy, b) = (0x7000, 0x8000, 0x9000);
        assert_eq!((t.shard_of(a, n), t.shard_of(busy, n)), (1, 2));
        t.shard_of(0xa000, n); // shard 3's stream, destroyed before the others start
        assert_eq!(t.shard_of(b, n), 1, "b shares a's shard");
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let workers: Vec<_> = [a, busy, b]
            .into_iter()
            .map(|h| {
                let (t, l, stop) = (t.clone(), l.clone(), stop.clone());
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        alloc_on(&t, &l, h, n);
                        std::thread::yield_now(); // let the other stream in between
                    }
                })
            })
            .collect();
        let apart = || {
            let (sa, sb, sc) = (t.shard_of(a, n), t.shard_of(b, n), t.shard_of(busy, n));
            sa != sb && sb != sc && sa != sc
        };
        let t0 = Instant::now();
        while !apart() && t0.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(1));
        }
        // Once apart no stream meets another, so nothing moves again. (A mover may take the
        // busy stream's shard when that thread was descheduled for the whole window, as on
        // a loaded machine; the busy stream then moves in turn.)
        let placed = [a, b, busy].map(|h| t.shard_of(h, n));
        std::thread::sleep(Duration::from_millis(50));
        stop.store(true, Ordering::Relaxed);
        workers.into_iter().for_each(|w| w.join().unwrap());
        assert!(apart(), "still sharing after {:?}", t0.elapsed());
        assert_eq!([a, b, busy].map(|h| t.shard_of(h, n)), placed, "a stream moved after all were apart");
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
        let t = Arc::new(StreamShards::new());
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
