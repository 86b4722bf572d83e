//! What a range's books say, asked without changing them: its free runs of whole granules,
//! idle nodes, free blocks, mapped granules.

use super::*;

impl Space {
    /// Free memory as whole granules: the granule-aligned interior of each run of adjacent
    /// free nodes (a granule can span free nodes of several streams), with the streams whose
    /// work must finish before it is unmapped and when the run was last freed.
    pub fn free_granule_runs(&self) -> Vec<FreeRun> {
        let g = self.granule;
        let mut out = Vec::new();
        let mut cur: Option<(usize, usize, Vec<StreamKey>, u64)> = None;
        let mut close = |run: Option<(usize, usize, Vec<StreamKey>, u64)>| {
            if let Some((start, end, streams, freed_at)) = run {
                let (a, b) = ((start + g - 1) & !(g - 1), end & !(g - 1));
                if a < b {
                    out.push(FreeRun { addr: a, len: b - a, streams, freed_at });
                }
            }
        };
        for n in self.idle_nodes().iter() {
            // An allocated node between (a gap in the idle nodes) or unmapped space ends a run.
            if n.state != State::Free || cur.as_ref().is_some_and(|c| c.1 != n.addr) {
                close(cur.take());
            }
            if n.state != State::Free {
                continue;
            }
            match cur.as_mut() {
                Some((_, end, streams, freed_at)) => {
                    *end = n.end();
                    if !streams.contains(&n.stream) {
                        streams.push(n.stream);
                    }
                    *freed_at = (*freed_at).max(n.freed_at);
                }
                None => cur = Some((n.addr, n.end(), vec![n.stream], n.freed_at)),
            }
        }
        close(cur.take());
        out
    }

    /// The free and unmapped nodes, in address order: what planning reads. Found by one pass
    /// over the slab (contiguous memory) and a sort of the few idle nodes, not by walking
    /// the links: the walk touches every node in an order unrelated to where it lies in
    /// memory, which costs a cache miss a node when the books are cold (as between a
    /// framework's calls), and planning runs for every request no free block serves. Two
    /// idle nodes are neighbours in the range exactly when one ends where the next starts.
    pub fn idle_nodes(&self) -> Vec<Node> {
        let mut idle: Vec<Node> = self.slab.nodes.iter().filter(|n| matches!(n.state, State::Free | State::Unmapped)).copied().collect();
        idle.sort_unstable_by_key(|n| n.addr);
        idle
    }

    /// Whether every free block here is `stream`'s (or there is none).
    pub fn free_only_on(&self, stream: StreamKey) -> bool {
        self.index.iter().all(|(&k, b)| k == stream || b.is_empty())
    }

    pub fn free_count(&self) -> usize {
        self.free_count
    }

    pub fn largest_free(&self) -> usize {
        self.index.values().filter_map(|b| b.largest().map(|e| e.0)).max().unwrap_or(0)
    }

    pub fn free_blocks(&self) -> Vec<Block> {
        self.walk().filter(|(_, n)| n.state == State::Free).map(|(s, _)| self.block_of(s)).collect()
    }

    pub fn is_free_block(&self, addr: usize) -> bool {
        self.walk().any(|(_, n)| n.state == State::Free && n.addr == addr)
    }

    /// The smallest run of unmapped address space of at least `len` bytes: its start.
    pub fn unmapped_run(&self, len: usize) -> Option<usize> {
        self.walk()
            .filter(|(_, n)| n.state == State::Unmapped && n.size >= len)
            .min_by_key(|(_, n)| (n.size, n.addr))
            .map(|(_, n)| n.addr)
    }

    /// Whether the granule at `g` is mapped (walks: invariant scans only).
    pub fn is_mapped(&self, g: usize) -> bool {
        self.node_at(g).is_some_and(|s| self.slab.nodes[s as usize].state != State::Unmapped)
    }

    /// Mapped bytes by the books: the granules touched by free and allocated nodes.
    pub fn mapped_bytes(&self) -> usize {
        self.used_bytes + self.free_bytes
    }
}
