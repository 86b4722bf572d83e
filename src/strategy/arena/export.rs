//! Exported blocks of the arena: another process maps whole granules, so while an exported
//! block lives the free memory in its granules is set aside (its guards), until the block is
//! freed (`put` calls `unguard`). Where the exports are recorded is the pool's business
//! (`crate::share::exports`): a strategy never touches the export record.

use super::{space, ArenaStrategy};
use crate::block::Block;

/// The arena's books of exported blocks.
#[derive(Default)]
pub(super) struct Exports {
    /// Exported blocks (`guard_export`): block address -> the free memory of its granules,
    /// booked as allocated in its space (space, node) while the block lives, so no other
    /// block is placed where the importing process can read and write.
    guarded: rustc_hash::FxHashMap<usize, Vec<(usize, space::Slot)>>,
    /// Bytes those guards hold (free memory set aside: counted as cached).
    pub(super) guard_bytes: usize,
}

impl Exports {
    /// No block is guarded (`put` skips `unguard`).
    pub(super) fn is_empty(&self) -> bool {
        self.guarded.is_empty()
    }
}

impl ArenaStrategy {
    /// Make the live block `[addr, addr + size)` exportable: another process maps whole
    /// granules (`gpupool_ipc_export`), so the granules under the block must hold nothing
    /// else while it lives. Refused (saying why) where another live block shares one; free
    /// memory in them is set aside until the block is freed (`put`). A stitched block's
    /// granules are its own already.
    pub fn guard_export(&mut self, addr: usize, size: usize) -> Result<(), String> {
        if self.exports.guarded.contains_key(&addr) {
            return Ok(());
        }
        if self.stitches.contains(addr) {
            return self.guard_stitched(addr, size);
        }
        let g = self.granule;
        let si = self.space_of(addr);
        // Whole allocations: a chunk is mapped whole by the importer.
        let (first, end) = self.export_extent(addr, size);
        let overlapping: Vec<(space::Node, space::Slot)> =
            self.spaces[si].walk().filter(|(_, n)| n.addr < end && n.end() > first).map(|(s, n)| (*n, s)).collect();
        if let Some((n, _)) = overlapping.iter().find(|(n, _)| n.state == space::State::Allocated && n.addr != addr) {
            return Err(format!(
                "the block shares its {} KiB granule(s) with the live block at {:#x}, which the importer could then read and \
                 write; allocate what you share at least one granule ({} KiB) large, before smaller blocks fill its granules, \
                 or copy it into such a block",
                g >> 10,
                n.addr,
                g >> 10
            ));
        }
        let mut guards = Vec::new();
        for (n, _) in overlapping.into_iter().filter(|(n, _)| n.state == space::State::Free) {
            let (a, e) = (n.addr.max(first), n.end().min(end));
            // One guard per free node, carved with that node's stream: the memory goes back
            // as free memory of the stream that freed it, not of the exported block's.
            let b = self.spaces[si].carve_range(a, e - a, n.stream);
            self.exports.guard_bytes += b.size;
            guards.push((si, b.handle));
        }
        self.exports.guarded.insert(addr, guards);
        Ok(())
    }

    /// `guard_export` for a stitched block: the importer maps the stitch's allocations whole,
    /// so it also sees what their home granules hold besides the block: the granules around
    /// the block that lie in the same chunks, and the other parts of granules the block takes
    /// only pieces of. Their free memory is set aside while the block lives; where another
    /// live block holds any of it, the export is refused.
    fn guard_stitched(&mut self, addr: usize, size: usize) -> Result<(), String> {
        let g = self.granule;
        let (first, end) = self.export_extent(addr, size);
        let Some((_, st)) = self.stitches.iter().find(|(_, s)| addr >= s.base && addr < s.base + s.len) else {
            return Ok(());
        };
        let homes: Vec<usize> = ((first - st.base) / g..(end - st.base) / g).map(|j| st.homes[j]).collect();
        let own = st.borrowed.clone();
        let large = super::LARGE;
        let nodes: Vec<(space::Node, space::Slot)> = self.spaces[large]
            .walk()
            .filter(|(s, n)| !own.contains(s) && homes.iter().any(|&h| n.addr < h + g && n.end() > h))
            .map(|(s, n)| (*n, s))
            .collect();
        if let Some((n, _)) = nodes.iter().find(|(n, _)| n.state == space::State::Allocated) {
            return Err(format!(
                "the stitched block shows allocations whose memory also holds the live block at {:#x}, which the importer \
                 could then read and write; copy what you share into a block of its own",
                n.addr
            ));
        }
        let mut guards = Vec::new();
        for (n, _) in nodes.iter().filter(|(n, _)| n.state == space::State::Free) {
            for &h in homes.iter().filter(|&&h| n.addr < h + g && n.end() > h) {
                let (a, e) = (n.addr.max(h), n.end().min(h + g));
                let b = self.spaces[large].carve_range(a, e - a, n.stream);
                self.exports.guard_bytes += b.size;
                guards.push((large, b.handle));
            }
        }
        self.exports.guarded.insert(addr, guards);
        Ok(())
    }

    /// The guards of exported block `addr` go back as free memory (it was freed).
    pub(super) fn unguard(&mut self, addr: usize) {
        for (si, slot) in self.exports.guarded.remove(&addr).unwrap_or_default() {
            let n = *self.spaces[si].node(slot);
            self.exports.guard_bytes -= n.size;
            let base = self.spaces[si].base;
            self.spaces[si].put(Block { addr: n.addr, size: n.size, segment: base, stream: n.stream, handle: slot });
        }
    }
}
