//! The exports of one pool's live blocks (`BlockExports`): where each exported block's
//! exports are recorded in this process's export record, with the digest of the granule
//! list each shares, and a pause's closing of them (refused, naming the receivers, while
//! one has them open). The pool keeps one; the strategy that placed the block knows nothing
//! of it (it only sets the block's granules aside, `guard_export`).
//!
//! Why per block: a block sent again (weights pushed every step) reuses its export, so its
//! descriptor is the same bytes and sends never run the record out of slots; and a freed
//! block ends its exports before its memory can serve another allocation, so a descriptor
//! of it can no longer map that memory.

use crate::error::{Error, Result};
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

    /// Before a pause: every export of the pool's blocks marked closing in this process's
    /// opens file, so that no import of them opens meanwhile; refused (naming the blocks and
    /// the processes), with nothing changed, while another process still has one open
    /// through gpupool (`share::protocol::opens_file`; a receiver that exited counts no more).
    /// Receivers on PyTorch's own allocator keep no count: they are not seen here.
    pub fn close_for_pause(&self, name: &str) -> Result<()> {
        let exports = self.all();
        let ats: Vec<_> = exports.iter().map(|e| e.1).collect();
        let Err(open) = ExportRecord::close_for_pause(&ats) else { return Ok(()) };
        let mut held: Vec<(usize, u32, u32)> =
            open.iter().filter_map(|&(at, n, pid)| exports.iter().find(|e| e.1 == at).map(|e| (e.0, n, pid))).collect();
        held.sort_unstable();
        held.dedup_by_key(|h| h.0);
        let mut pids: Vec<u32> = held.iter().map(|h| h.2).filter(|&p| p != 0).collect();
        pids.sort_unstable();
        pids.dedup();
        let shown: Vec<String> = held.iter().take(8).map(|(a, n, pid)| format!("{a:#x} ({n} open, last by process {pid})")).collect();
        Err(Error::Busy(format!(
            "pause `{name}`: {} of its blocks are still mapped by the process(es) they were sent to ({}): {}{}; pausing \
             now would give the device nothing back and leave the receivers reading memory the resume no longer \
             updates. Have the receivers let go first (drop every tensor made from the blocks; PyTorch's sender then \
             runs torch.cuda.ipc_collect()), then pause again",
            held.len(),
            pids.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(", "),
            shown.join(", "),
            if held.len() > shown.len() { ", ..." } else { "" }
        )))
    }

    /// Imports of these exports may open again (a pause that did not go ahead, or a
    /// resume).
    pub fn reopen(&self) {
        ExportRecord::reopen(&self.records());
    }
}
