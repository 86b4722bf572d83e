//! Loans between the arena's two ranges: a range that needs memory shows the other range's
//! whole free granules (one alias each) before it maps new memory. Why: the ranges peak at
//! different times (a server's small activations against its KV caches), and without loans
//! the pool holds the sum of the two peaks (`docs/arena.md`, "Loans and scraps (serving)"). The pool makes the
//! driver calls (`Pool::map_window`, `Pool::arena_release`); this file keeps the books.
//!
//! A loan books its home as allocated in the home's range and the borrowed granule as mapped
//! free memory in the other; it ends only when the borrowed granule is released (the pool
//! removes the alias, and the home is free again in its own range). A granule whose alias
//! the driver would not remove (a failed loan) stays in quarantine, booked as allocated,
//! until the pool removes it (`quarantine`, `unstick`).

use super::{plan, ArenaStrategy, FreeRun, SMALL};
use crate::block::Block;
use crate::upstream::stream_id::StreamKey;

/// Whether granules under a cached stitch's aliases may be lent. No: lending one makes the
/// stitch unusable until the loan ends, and in the serving replay that cost more memory
/// than it saved (docs/arena.md, "Alternatives considered").
const STITCHED_LENDABLE: bool = false;

impl ArenaStrategy {
    /// Up to `n` whole free granules of the range other than `space` that `space` may show
    /// instead of new memory (`lend`), longest idle first, asking `reusable` as a stitch
    /// does. Why: the two ranges peak at different times (a server's small activations
    /// against its KV caches), and without this one range maps new memory while the other
    /// holds free granules, so the pool holds the sum of the two peaks.
    pub fn lendable(&self, space: usize, n: usize, stream: StreamKey, reusable: &mut dyn FnMut(StreamKey, usize, usize) -> bool) -> Vec<usize> {
        if n == 0 {
            return Vec::new();
        }
        // Granules under a cached stitch's aliases stay with their range: lending one would
        // make the stitch unusable until the loan ends.
        let stitched: std::collections::HashSet<usize> = self.stitches.iter().flat_map(|(_, s)| s.homes.iter().copied()).collect();
        let (free, under_stitches): (Vec<FreeRun>, Vec<FreeRun>) = self
            .home_runs(1 - space)
            .into_iter()
            .flat_map(|r| {
                let g = self.granule;
                (r.addr..r.addr + r.len).step_by(g).map(move |a| FreeRun { addr: a, len: g, ..r.clone() })
            })
            .filter(|r| self.chunks.of(r.addr).is_none()) // a chunk is aliased whole, never lent
            .partition(|r| !stitched.contains(&r.addr));
        let mut homes = plan::stitch_homes(&free, n, self.granule, stream, reusable);
        if STITCHED_LENDABLE && homes.len() < n {
            homes.extend(plan::stitch_homes(&under_stitches, n - homes.len(), self.granule, stream, reusable));
        }
        homes
    }

    /// Runs of whole free granules of range `si` that hold their own memory: a lent granule
    /// shows another's through an alias, and an alias cannot be aliased again (the driver
    /// maps an allocation's handle, which only its home has).
    pub(super) fn home_runs(&self, si: usize) -> Vec<FreeRun> {
        super::release::split_runs(self.spaces[si].free_granule_runs(), self.granule, |a| self.loans.contains_key(&a))
    }

    /// The pool aliased the other range's free granule `home` at the unmapped granule `at`:
    /// `home` is booked as allocated (its memory is `at`'s range's now) and `at` as mapped,
    /// free memory of `stream`. No memory was added.
    pub fn lend(&mut self, at: usize, home: usize, stream: StreamKey) {
        let (g, si) = (self.granule, self.space_of(at));
        let b = self.spaces[1 - si].carve_range(home, g, stream);
        self.spaces[si].mark_mapped(at, g, stream);
        self.loans.insert(at, b.handle);
        self.small_loans += usize::from(si == SMALL);
        self.counters.granules_lent += 1;
    }

    /// Whether granule `at` shows a granule of the other range (`lend`).
    pub fn is_lent(&self, at: usize) -> bool {
        self.loans.contains_key(&at)
    }

    /// The pool removed the alias at the free granule `at`: its home goes back to its range
    /// as free memory of `stream`. Returns the home's address.
    pub fn end_loan(&mut self, at: usize, stream: StreamKey) -> usize {
        let slot = self.loans.remove(&at).expect("a lent granule");
        let si = self.space_of(at);
        self.spaces[si].mark_unmapped(at, self.granule);
        self.small_loans -= usize::from(si == SMALL);
        let home_space = &mut self.spaces[1 - si];
        let n = *home_space.node(slot);
        let home = Block { addr: n.addr, size: n.size, segment: home_space.base, stream, handle: slot };
        home_space.put(home);
        self.counters.loans_ended += 1;
        n.addr
    }

    /// The pool could not remove the alias of the other range's free granule `home` left at
    /// the unmapped granule `at` (a failed loan): keep everything off both until `unstick`.
    /// The home's memory stays with the driver while the alias lives, so it is booked as
    /// allocated (as a loan's home) rather than left free to be handed out or given back.
    pub fn quarantine(&mut self, at: usize, home: usize, stream: StreamKey) {
        let (g, si) = (self.granule, self.space_of(at));
        self.spaces[si].mark_mapped(at, g, stream);
        let slot = self.spaces[si].carve_range(at, g, stream).handle;
        let home = self.spaces[1 - si].carve_range(home, g, stream).handle;
        self.stuck.insert(at, Stuck { slot, home, stream });
    }

    /// Granules in quarantine, for the pool to retry removing their aliases.
    pub fn stuck(&self) -> Vec<usize> {
        self.stuck.keys().copied().collect()
    }

    /// The alias at quarantined granule `at` is gone: it is unmapped address space again, and
    /// its home free memory of the stream that borrowed it (which had waited for the home's
    /// earlier streams before the alias was made).
    pub fn unstick(&mut self, at: usize) {
        let st = self.stuck.remove(&at).expect("a quarantined granule");
        let si = self.space_of(at);
        let n = *self.spaces[si].node(st.slot);
        let base = self.spaces[si].base;
        self.spaces[si].put(Block { addr: n.addr, size: n.size, segment: base, stream: st.stream, handle: st.slot });
        self.spaces[si].mark_unmapped(at, self.granule);
        let home_space = &mut self.spaces[1 - si];
        let h = *home_space.node(st.home);
        let base = home_space.base;
        home_space.put(Block { addr: h.addr, size: h.size, segment: base, stream: st.stream, handle: st.home });
    }
}

/// A quarantined alias (`ArenaStrategy::quarantine`): its node, its home's node in the other
/// range, and the stream that made it.
#[derive(Copy, Clone, Debug)]
pub(super) struct Stuck {
    pub slot: super::space::Slot,
    pub home: super::space::Slot,
    pub stream: StreamKey,
}
