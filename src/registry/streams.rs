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
//! across streams with event queries. Those threads
//! seldom meet on the lock (their thread caches take none), so a lock found taken is too
//! rare a sign; and a lock contended by threads of *one* stream is no sign at all (moving
//! that stream helps nobody). The sign used is the shard's *last allocating stream*: every
//! locked allocation on a stream shard notes its stream there (`allocating`); one that
//! finds another stream noted counts an alternation on the shard. Everything a shard notes
//! is written only by its lock holder, on a cache line of its own: a shard one stream uses
//! costs that stream's thread a line it already owns.
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
                super::which_shard::placements_changed();
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
mod tests;
