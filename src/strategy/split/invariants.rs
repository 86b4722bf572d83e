//! The invariants of `split`'s books, checked together (`Strategy::check_invariants`):
//! segments are linked slot by slot with no gap, free neighbours on one stream are
//! coalesced, every free node is indexed once, the quick cache holds allocated nodes only,
//! and the counters match what the nodes hold.

use super::{SplitStrategy, State, EMPTY_INDEXES_KEPT, QUICK_MAX};
use crate::block::MIN_ALIGN;
use crate::strategy::slab::{Slot, NIL};
use crate::upstream::stream_id::StreamKey;
use rustc_hash::FxHashMap;

impl SplitStrategy {
    /// Every invariant of the books (module docs), or what breaks first.
    pub(super) fn check_books(&self) -> Result<(), String> {
        let mut seen = 0usize;
        let mut cached = 0usize;
        let mut indexed = 0usize;
        let mut quick = 0usize;
        let mut quick_of: FxHashMap<Slot, (StreamKey, usize, usize)> = FxHashMap::default();
        if self.quick.len() > QUICK_MAX {
            return Err(format!("{} blocks in the quick cache (max {QUICK_MAX})", self.quick.len()));
        }
        for &(stream, size, addr, _, s) in &self.quick {
            if quick_of.insert(s, (stream, size, addr)).is_some() {
                return Err(format!("block {addr:#x} twice in the quick cache"));
            }
        }
        for (&base, info) in &self.segments {
            let mut s = info.first;
            let mut prev = NIL;
            let mut total = 0;
            let mut addr = base;
            while s != NIL {
                let n = self.slab.nodes.get(s as usize).ok_or_else(|| format!("segment {base:#x}: slot {s} out of range"))?;
                if n.state == State::Vacant || n.addr != addr {
                    return Err(format!("segment {base:#x}: slot {s} is {n:?}, expected a block at {addr:#x}"));
                }
                if n.prev != prev || n.segment != base || n.class != info.class {
                    return Err(format!("node {addr:#x}: bad links {n:?} (expected prev {prev})"));
                }
                if addr % MIN_ALIGN != 0 || n.size == 0 {
                    return Err(format!("node {addr:#x}: misaligned or empty"));
                }
                match n.state {
                    State::Free => {
                        cached += n.size;
                        indexed += 1;
                        if !self.free_index.get(&(info.class, n.stream)).is_some_and(|set| set.contains(n.size, addr)) {
                            return Err(format!("free node {addr:#x} not indexed"));
                        }
                        if n.next != NIL {
                            let nx = &self.slab.nodes[n.next as usize];
                            if nx.state == State::Free && nx.stream == n.stream {
                                return Err(format!("free neighbours {addr:#x} and {:#x} not coalesced", nx.addr));
                            }
                        }
                    }
                    State::Allocated => {
                        if let Some(&(_, size, qaddr)) = quick_of.get(&s) {
                            if size != n.size || qaddr != addr {
                                return Err(format!("quick block {qaddr:#x} ({size} B) filed as slot {s}, {n:?}"));
                            }
                            cached += n.size;
                            quick += 1;
                        }
                    }
                    State::Vacant => unreachable!("checked above"),
                }
                total += n.size;
                addr += n.size;
                seen += 1;
                prev = s;
                s = n.next;
            }
            if total != info.size {
                return Err(format!("segment {base:#x}: blocks cover {total} of {} bytes", info.size));
            }
        }
        let occupied = self.slab.occupied();
        if seen != occupied || self.slab.vacant.iter().any(|&s| self.slab.nodes[s as usize].state != State::Vacant) {
            return Err(format!("{occupied} occupied slots, {seen} reachable from segments"));
        }
        let in_sets: usize = self.free_index.values().map(|s| s.len()).sum();
        if indexed != in_sets || indexed != self.free_count || quick != self.quick.len() {
            return Err(format!(
                "index {in_sets} (count {}) vs {indexed} free nodes, quick {} vs {quick}",
                self.free_count,
                self.quick.len()
            ));
        }
        if cached != self.cached {
            return Err(format!("cached {} but free nodes hold {cached}", self.cached));
        }
        let empty = self.free_index.iter().filter(|(k, set)| set.is_empty() && k.1 != StreamKey::LEGACY).count();
        if empty != self.empty_kept || empty > EMPTY_INDEXES_KEPT {
            return Err(format!("{empty} empty indexes of non-legacy streams kept (counted {})", self.empty_kept));
        }
        Ok(())
    }
}
