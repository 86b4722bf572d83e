//! What the arena gives back under pressure: runs of whole free allocations (granules,
//! chunks whole), in the order they should go.

use super::space::FreeRun;
use super::ArenaStrategy;
use crate::strategy::ReleaseOrder;

impl ArenaStrategy {
    /// Runs of whole free granules, in the order they should go back. Granules shown by a
    /// handed-out stitch stay (its aliases are one mapping the pool cannot cut into while
    /// the block lives); they can go once it is freed.
    pub fn releasable(&self, order: ReleaseOrder) -> Vec<FreeRun> {
        let g = self.granule;
        let pinned: std::collections::HashSet<usize> =
            self.stitches.iter().filter(|(_, s)| s.in_use).flat_map(|(_, s)| s.homes.iter().copied()).collect();
        let mut runs = self.chunks.whole_runs(split_runs(self.spaces.iter().flat_map(|s| s.free_granule_runs()), g, |a| pinned.contains(&a)));
        match order {
            ReleaseOrder::LargestFirst => runs.sort_unstable_by(|a, b| b.len.cmp(&a.len).then(a.addr.cmp(&b.addr))),
            ReleaseOrder::OldestFirst => runs.sort_unstable_by_key(|r| (r.freed_at, r.addr)),
        }
        runs
    }
}

/// `runs` cut around every granule `excluded` names (granules of `g` bytes): what is left
/// of each run, in order.
pub(super) fn split_runs(runs: impl IntoIterator<Item = FreeRun>, g: usize, excluded: impl Fn(usize) -> bool) -> Vec<FreeRun> {
    let mut out = Vec::new();
    for r in runs {
        let mut start = r.addr;
        for a in (r.addr..r.addr + r.len).step_by(g).chain(std::iter::once(r.addr + r.len)) {
            if a == r.addr + r.len || excluded(a) {
                if a > start {
                    out.push(FreeRun { addr: start, len: a - start, ..r.clone() });
                }
                start = a + g;
            }
        }
    }
    out
}
