//! Which shard of a device's pool serves a stream: user streams are dealt out to the
//! device's stream shards round robin, the first time each is seen, and keep their shard
//! unless they find it shared (below). The legacy stream, the per-thread default stream and
//! callers that name no stream stay on shard 0.
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
//! table is full, further handles are placed by a hash (and never move). A device remade
//! with another shard count (`gpupool_configure`) keeps the placements, modulo the new count.
//!
//! Why streams move, and when. A placement can go stale: a destroyed stream keeps its entry,
//! so a recycled handle keeps the old stream's shard, and the round-robin turn goes on from
//! wherever earlier streams left it. Threads started together (a server's workers, each
//! creating its stream) can so find two live streams on one shard and another shard unused.
//! Two streams sharing a shard cost far more than a lock: each is refused the other's blocks
//! still pending on the other stream, the shard grows with driver calls, and blocks move
//! across streams with event queries (seen on the H200: 308 and 550 `cuMemAlloc` calls and
//! thousands of cross-stream reuses in a 16-thread row that a clean placement runs with 17
//! and none). Those threads seldom meet on the lock (their thread caches take none), so a
//! lock found taken is too rare a sign; and a lock contended by threads of *one* stream is
//! no sign at all (moving that stream helps nobody). The sign used is the shard's *last
//! allocating stream*: every locked allocation on a stream shard notes its stream there
//! (`allocating`); one that finds another stream noted counts an alternation on the shard.
//! Everything a shard notes is written only by its lock holder, on a cache line of its own:
//! a shard one stream uses costs that stream's thread a line it already owns.
//!
//! Where a stream moves: after `MOVE_AFTER` alternations on its shard, the stream allocating
//! then moves to a shard that made no locked allocation since the shard's halfway
//! alternation, at least `IDLE_WINDOW` before (each thread keeps the counts it saw there,
//! `SEEN`). A shard busy in that window has a live stream of its own; with none idle (more
//! live streams than shards) the stream stays, as moving would only make another pair share.
//! A mover claims its shard by advancing that shard's count, so a second stream judging
//! at the same time sees it busy and stays. The search starts at the thread's own turn
//! (`thread_turn`), so threads moving at once try different shards first. What this cannot
//! see: a live stream whose thread makes no locked allocation for the whole window (all
//! thread-cache hits, or descheduled) looks idle, and a mover may join it; they then
//! alternate, and one of them moves on, at the same cost again.

use super::SHARDS;
use std::cell::Cell;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Turns handed to threads whose streams moved (`thread_turn`).
static TURNS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// This thread's turn, `usize::MAX` until it first needs one.
    static TURN: Cell<usize> = const { Cell::new(usize::MAX) };
    /// The shards' allocation counts this thread saw at a shard's halfway alternation.
    static SEEN: Cell<Option<Seen>> = const { Cell::new(None) };
}

/// What a thread saw at a shard's halfway alternation (`StreamShards::allocating`).
#[derive(Copy, Clone)]
struct Seen {
    /// The table (its address) and the shard the counts were taken for.
    table: usize,
    shard: usize,
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
/// of its own. The holder writes with plain loads and stores (it holds the lock); the one
/// other writer is a stream moving here, which advances `allocs` by a compare-and-swap and
/// sets `last_stream` (either write racing the holder's still leaves `allocs` changed,
/// which is all a mover's claim needs).
#[repr(align(128))]
struct Activity {
    /// The stream of the shard's last locked allocation (0: none yet).
    last_stream: AtomicUsize,
    /// Locked allocations on user streams, wrapping.
    allocs: AtomicU32,
    /// Allocations that found another stream noted, since the last judgement.
    alternations: AtomicU32,
}

pub struct StreamShards {
    /// Stream handles (0 = free entry; the legacy stream never enters).
    handles: [AtomicUsize; ENTRIES],
    shards: [AtomicU32; ENTRIES],
    /// Streams placed so far (the next one's turn).
    placed: AtomicUsize,
    /// Per shard (index as in the registry: 1..=n are stream shards).
    activity: [Activity; SHARDS],
}

/// Alternations on a shard after which its allocating stream moves to a shard seen idle
/// (module docs).
const MOVE_AFTER: u32 = 32;
/// Counts older than this are taken again rather than judged by: a shard that worked an
/// hour ago says nothing of now (an old window only makes more shards look busy).
const SEEN_MAX_AGE: Duration = Duration::from_secs(1);
/// The shortest time a shard must make no locked allocation to be seen idle: a live
/// stream's thread may go this long on its thread cache alone, not much longer (its cache
/// holds a few blocks; a workload that never misses it never allocates under the lock).
const IDLE_WINDOW: Duration = Duration::from_millis(2);

#[allow(clippy::declare_interior_mutable_const)]
const FREE_HANDLE: AtomicUsize = AtomicUsize::new(0);
#[allow(clippy::declare_interior_mutable_const)]
const UNSET_SHARD: AtomicU32 = AtomicU32::new(UNSET);
#[allow(clippy::declare_interior_mutable_const)]
const UNUSED: Activity = Activity { last_stream: AtomicUsize::new(0), allocs: AtomicU32::new(0), alternations: AtomicU32::new(0) };

impl StreamShards {
    pub const fn new() -> Self {
        StreamShards {
            handles: [FREE_HANDLE; ENTRIES],
            shards: [UNSET_SHARD; ENTRIES],
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

    /// An allocation on `handle` holds the lock of its shard `k` (`1..=n`): note it; one
    /// that finds another stream noted counts an alternation, and at `MOVE_AFTER` of them
    /// `handle` may move (module docs). A move changes only where later allocations go.
    pub fn allocating(&self, handle: usize, k: usize, n: usize) {
        let a = &self.activity[k];
        a.allocs.store(a.allocs.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
        let last = a.last_stream.load(Ordering::Relaxed);
        if last == handle {
            return;
        }
        a.last_stream.store(handle, Ordering::Relaxed);
        if last == 0 || n < 2 {
            return; // the shard's first stream, or nowhere to move to
        }
        let alternations = a.alternations.load(Ordering::Relaxed) + 1;
        a.alternations.store(alternations, Ordering::Relaxed);
        if alternations == MOVE_AFTER / 2 {
            self.remember_counts(k);
        } else if alternations >= MOVE_AFTER {
            self.judge(handle, k, n);
        }
    }

    /// `MOVE_AFTER` alternations on shard `k`, the last one by `handle` (under `k`'s lock):
    /// move `handle` to a shard idle since this thread's halfway counts, if one is.
    fn judge(&self, handle: usize, k: usize, n: usize) {
        let alternations = &self.activity[k].alternations;
        let seen = SEEN.with(|c| c.get()).filter(|s| s.table == self as *const _ as usize && s.shard == k);
        let Some(seen) = seen.filter(|s| s.at.elapsed() < SEEN_MAX_AGE) else {
            // Another thread took the halfway counts, or this one's are stale or for
            // another shard: the window starts here.
            self.remember_counts(k);
            alternations.store(MOVE_AFTER / 2, Ordering::Relaxed);
            return;
        };
        if seen.at.elapsed() < IDLE_WINDOW {
            alternations.store(MOVE_AFTER - 1, Ordering::Relaxed); // judge at the next one
            return;
        }
        alternations.store(0, Ordering::Relaxed);
        SEEN.with(|c| c.set(None));
        // Only a stream this table placed on `k` moves (not one placed by hash, nor one
        // another thread moved already).
        let Some(e) = self.entry(handle).filter(|&e| self.wait_for(e, n) == k) else { return };
        let first = thread_turn(n, k - 1);
        for to in (0..n).map(|i| (first + i) % n).filter(|&to| to != k - 1) {
            let a = &self.activity[1 + to];
            let was = seen.allocs[1 + to];
            // Idle since the halfway counts, and claimed: a stream judging at the same time
            // with counts taken before this finds the shard busy.
            if a.allocs.compare_exchange(was, was.wrapping_add(1), Ordering::AcqRel, Ordering::Acquire).is_ok() {
                a.last_stream.store(handle, Ordering::Release); // arriving is no alternation
                self.shards[e].store(to as u32, Ordering::Release);
                super::route::placements_changed();
                return;
            }
        }
    }

    /// Keep, for this thread, every shard's allocation count now (shard `k`'s halfway
    /// alternation).
    fn remember_counts(&self, k: usize) {
        let mut allocs = [0u32; SHARDS];
        for (c, a) in allocs.iter_mut().zip(&self.activity) {
            *c = a.allocs.load(Ordering::Acquire);
        }
        let seen = Seen { table: self as *const _ as usize, shard: k, at: Instant::now(), allocs };
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

    /// `count` allocations taking turns between `streams` (all on one shard): each one
    /// after the shard's first is an alternation.
    fn take_turns(t: &StreamShards, l: &[std::sync::Mutex<()>], streams: [usize; 2], count: u32, n: usize, turn: &mut usize) {
        for _ in 0..count {
            alloc_on(t, l, streams[*turn % 2], n);
            *turn += 1;
        }
    }

    #[test]
    fn a_stream_sharing_its_shard_moves_to_the_idle_one() {
        // One thread drives both streams, as a thread serving two streams would.
        let (t, l, n) = (StreamShards::new(), locks(), 4);
        let (a, b, c, gone, x) = (0x1000, 0x2000, 0x3000, 0x4000, 0x5000);
        let placed: Vec<usize> = [a, b, c, gone, x].iter().map(|&h| t.shard_of(h, n)).collect();
        assert_eq!(placed, [1, 2, 3, 4, 1], "x is dealt a's shard; the stream on 4 is gone");
        let mut turn = 0;
        take_turns(&t, &l, [a, x], 1 + MOVE_AFTER / 2, n, &mut turn); // the halfway counts
        alloc_on(&t, &l, b, n); // shards 2 and 3 work in the window; 4 does not
        alloc_on(&t, &l, c, n);
        std::thread::sleep(IDLE_WINDOW);
        take_turns(&t, &l, [a, x], MOVE_AFTER / 2 - 1, n, &mut turn);
        assert_eq!((t.shard_of(a, n), t.shard_of(x, n)), (1, 1), "fewer alternations move nothing");
        let epoch = super::super::route::placement_epoch();
        take_turns(&t, &l, [a, x], 1, n, &mut turn);
        let mut now = [t.shard_of(a, n), t.shard_of(x, n)];
        now.sort();
        assert_eq!(now, [1, 4], "one of the two moved, to the one idle shard");
        // Threads that remembered the old placement ask again (`thread_cache::route`).
        assert_ne!(super::super::route::placement_epoch(), epoch, "a move changes the placement epoch");
        assert_eq!((t.shard_of(b, n), t.shard_of(c, n)), (2, 3));
        // Apart, they no longer alternate: nothing moves again.
        for _ in 0..4 * MOVE_AFTER {
            alloc_on(&t, &l, a, n);
            alloc_on(&t, &l, x, n);
        }
        let mut later = [t.shard_of(a, n), t.shard_of(x, n)];
        later.sort();
        assert_eq!(later, [1, 4]);
    }

    #[test]
    fn a_stream_stays_when_every_other_shard_is_busy() {
        let (t, l, n) = (StreamShards::new(), locks(), 3);
        let (a, b, c, x) = (0x1000, 0x2000, 0x3000, 0x4000);
        let placed: Vec<usize> = [a, b, c, x].iter().map(|&h| t.shard_of(h, n)).collect();
        assert_eq!(placed, [1, 2, 3, 1]);
        let mut turn = 0;
        take_turns(&t, &l, [a, x], 1, n, &mut turn); // the shard's first note: no alternation
        for round in 0..3 {
            take_turns(&t, &l, [a, x], MOVE_AFTER / 2, n, &mut turn);
            alloc_on(&t, &l, b, n);
            alloc_on(&t, &l, c, n);
            std::thread::sleep(IDLE_WINDOW);
            take_turns(&t, &l, [a, x], MOVE_AFTER / 2, n, &mut turn);
            assert_eq!((t.shard_of(a, n), t.shard_of(x, n)), (1, 1), "round {round}: moving would make another pair share");
        }
    }

    #[test]
    fn a_second_stream_judging_at_once_does_not_follow_the_first() {
        // a and x share shard 1, shard 3's stream is gone, b works on shard 2. Both threads
        // took their halfway counts, then judge one after the other: the first moves to 3
        // and claims it, the second must find 3 busy and stay (else they share again).
        let (t, l, n) = (Arc::new(StreamShards::new()), Arc::new(locks()), 3);
        let (a, b, gone, x) = (0x1000, 0x2000, 0x3000, 0x4000);
        let placed: Vec<usize> = [a, b, gone, x].iter().map(|&h| t.shard_of(h, n)).collect();
        assert_eq!(placed, [1, 2, 3, 1]);
        alloc_on(&t, &l, a, n);
        let ready = Arc::new(std::sync::Barrier::new(2));
        let second = {
            let (t, l, ready) = (t.clone(), l.clone(), ready.clone());
            std::thread::spawn(move || {
                t.remember_counts(1); // x's thread at the halfway alternation
                ready.wait(); // counts taken
                ready.wait(); // a has moved
                let _g = l[1].lock().unwrap();
                t.activity[1].alternations.store(MOVE_AFTER - 1, Ordering::Relaxed);
                t.activity[1].last_stream.store(a, Ordering::Relaxed);
                t.allocating(x, 1, n); // the 32nd alternation: x judges
            })
        };
        t.remember_counts(1); // a's thread at the halfway alternation
        ready.wait();
        alloc_on(&t, &l, b, n); // shard 2 works in the window
        std::thread::sleep(IDLE_WINDOW);
        {
            let _g = l[1].lock().unwrap();
            t.activity[1].alternations.store(MOVE_AFTER - 1, Ordering::Relaxed);
            t.activity[1].last_stream.store(x, Ordering::Relaxed);
            t.allocating(a, 1, n); // a judges first
        }
        assert_eq!(t.shard_of(a, n), 3, "a moved to the idle shard");
        ready.wait();
        second.join().unwrap();
        assert_eq!(t.shard_of(x, n), 1, "x followed a onto the shard a claimed");
        assert_eq!(t.shard_of(b, n), 2);
    }

    #[test]
    fn a_stream_on_a_dead_streams_shard_does_not_move() {
        // A destroyed stream's note stays on its shard: the next stream there counts one
        // alternation, and never more.
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
    fn two_working_streams_on_one_shard_end_on_shards_of_their_own() {
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
