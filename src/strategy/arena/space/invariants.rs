//! The invariants of one arena range's books, checked together: nodes tile the range in
//! order, free nodes are indexed and merged with free neighbours on their stream, unmapped
//! nodes are whole merged granules, and the byte and node counts match the nodes.

use super::{Space, State, ROUND};
use crate::strategy::slab::NIL;
use crate::upstream::stream_id::StreamKey;

impl Space {
    pub fn check_invariants(&self) -> Result<(), String> {
        let g = self.granule;
        let (mut addr, mut prev, mut free, mut used, mut count, mut seen) = (self.base, NIL, 0, 0, 0, 0);
        let mut last_state = State::Vacant;
        let mut last_stream = StreamKey::LEGACY;
        for (s, n) in self.walk() {
            if n.addr != addr || n.prev != prev || n.size == 0 || n.size % ROUND != 0 {
                return Err(format!("node {s} {n:?}: expected address {addr:#x}, prev {prev}"));
            }
            match n.state {
                State::Free => {
                    if !self.index.get(&n.stream).is_some_and(|b| b.contains(n.size, n.addr)) {
                        return Err(format!("free node {n:?} not in the index"));
                    }
                    if last_state == State::Free && last_stream == n.stream {
                        return Err(format!("free node {n:?} not merged with its free neighbour"));
                    }
                    free += n.size;
                    count += 1;
                }
                State::Allocated => used += n.size,
                State::Unmapped => {
                    if n.addr % g != 0 || n.size % g != 0 || last_state == State::Unmapped {
                        return Err(format!("unmapped node {n:?} not whole granules, or not merged"));
                    }
                }
                State::Vacant => return Err(format!("vacant slot {s} linked")),
            }
            last_state = n.state;
            last_stream = n.stream;
            addr += n.size;
            prev = s;
            seen += 1;
        }
        if addr != self.base + self.len {
            return Err(format!("nodes end at {addr:#x}, the space at {:#x}", self.base + self.len));
        }
        if free != self.free_bytes || used != self.used_bytes || count != self.free_count {
            return Err(format!(
                "books: free {}/{free} bytes, {}/{count} nodes; used {}/{used}",
                self.free_bytes, self.free_count, self.used_bytes
            ));
        }
        let indexed: usize = self.index.values().map(|b| b.len()).sum();
        if indexed != count || self.slab.occupied() != seen {
            return Err(format!("{indexed} indexed vs {count} free nodes; {seen} linked slots"));
        }
        Ok(())
    }
}
