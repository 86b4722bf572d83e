//! Exported blocks of the arena: another process maps whole granules, so while an exported
//! block lives the free memory in its granules is set aside (its guards), and its exports
//! are recorded, to end when the block is freed (`put` calls `unguard`).

use super::{space, ArenaStrategy};
use crate::block::Block;
use crate::upstream::export_record::{ExportRecord, RecordRef};

/// The arena's books of exported blocks.
#[derive(Default)]
pub(super) struct Exports {
    /// Exported blocks (`guard_export`): block address -> the free memory of its granules,
    /// booked as allocated in its space (space, node) while the block lives, so no other
    /// block is placed where the importing process can read and write.
    guarded: rustc_hash::FxHashMap<usize, Vec<(usize, space::Slot)>>,
    /// Bytes those guards hold (free memory set aside: counted as cached).
    pub(super) guard_bytes: usize,
    /// Exported blocks -> where their exports are recorded, with the digest of the granule
    /// list each shares (`granules_digest`): a block freed ends them (`put`), so a
    /// descriptor of it cannot map memory that serves another block.
    records: rustc_hash::FxHashMap<usize, Vec<(RecordRef, u64)>>,
}

impl Exports {
    /// No block is guarded and no export recorded (`put` skips `unguard`).
    pub(super) fn is_empty(&self) -> bool {
        self.guarded.is_empty() && self.records.is_empty()
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

    /// Block `addr` was exported as `at`, sharing granules of digest `digest`: the export
    /// ends when the block is freed.
    pub fn note_export(&mut self, addr: usize, at: RecordRef, digest: u64) {
        self.exports.records.entry(addr).or_default().push((at, digest));
    }

    /// The export of live block `addr` that shares granules of digest `digest`, if one is
    /// still recorded: a block sent again (weights pushed every step) reuses its export, so
    /// its descriptor is the same bytes and sends never run the record out of slots.
    pub fn export_of(&mut self, addr: usize, digest: u64) -> Option<RecordRef> {
        let recs = self.exports.records.get_mut(&addr)?;
        // Exports whose granules were released meanwhile are over: forget them here too.
        recs.retain(|(at, _)| ExportRecord::is_live(*at));
        recs.iter().find(|(_, d)| *d == digest).map(|(at, _)| *at)
    }

    /// Every export still booked: (block address, where it is recorded).
    pub fn exports(&self) -> Vec<(usize, RecordRef)> {
        self.exports.records.iter().flat_map(|(&addr, recs)| recs.iter().map(move |&(at, _)| (addr, at))).collect()
    }

    /// The guards of exported block `addr` go back as free memory (it was freed), and its
    /// exports end.
    pub(super) fn unguard(&mut self, addr: usize) {
        for (at, _) in self.exports.records.remove(&addr).unwrap_or_default() {
            ExportRecord::end(at);
        }
        for (si, slot) in self.exports.guarded.remove(&addr).unwrap_or_default() {
            let n = *self.spaces[si].node(slot);
            self.exports.guard_bytes -= n.size;
            let base = self.spaces[si].base;
            self.spaces[si].put(Block { addr: n.addr, size: n.size, segment: base, stream: n.stream, handle: slot });
        }
    }
}
