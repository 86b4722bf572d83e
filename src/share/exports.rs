//! The exports of one pool's live blocks (`BlockExports`): where each exported block's
//! exports are recorded in this process's export record, with the digest of the granule
//! list each shares. The pool keeps one; the strategy that placed the block knows nothing
//! of it (it only sets the block's granules aside, `guard_export`).
//!
//! Why per block: a block sent again (weights pushed every step) reuses its export, so its
//! descriptor is the same bytes and sends never run the record out of slots; and a freed
//! block ends its exports before its memory can serve another allocation, so a descriptor
//! of it can no longer map that memory.

use crate::share::protocol::{ExportRecord, RecordRef};
use rustc_hash::FxHashMap;

#[derive(Default)]
pub struct BlockExports {
    by_block: FxHashMap<usize, Vec<(RecordRef, u64)>>,
}

impl BlockExports {
    /// No block has an export: a free has nothing to end.
    pub fn is_empty(&self) -> bool {
        self.by_block.is_empty()
    }

    /// The export of live block `addr` that shares granules of digest `digest`, if one is
    /// still recorded. Exports whose granules were released meanwhile (a pause) are over
    /// and forgotten here too.
    pub fn reusable(&mut self, addr: usize, digest: u64) -> Option<RecordRef> {
        let recs = self.by_block.get_mut(&addr)?;
        recs.retain(|(at, _)| ExportRecord::is_live(*at));
        recs.iter().find(|(_, d)| *d == digest).map(|(at, _)| *at)
    }

    /// Block `addr` was exported as `at`, sharing granules of digest `digest`.
    pub fn note(&mut self, addr: usize, at: RecordRef, digest: u64) {
        self.by_block.entry(addr).or_default().push((at, digest));
    }

    /// Block `addr` is being freed: its exports end now, before its memory goes back.
    pub fn end_block(&mut self, addr: usize) {
        for (at, _) in self.by_block.remove(&addr).unwrap_or_default() {
            ExportRecord::end(at);
        }
    }

    /// Every export still booked: (block address, where it is recorded).
    pub fn all(&self) -> Vec<(usize, RecordRef)> {
        self.by_block.iter().flat_map(|(&addr, recs)| recs.iter().map(move |&(at, _)| (addr, at))).collect()
    }

    /// Where every booked export is recorded.
    pub fn records(&self) -> Vec<RecordRef> {
        self.by_block.values().flatten().map(|&(at, _)| at).collect()
    }
}
