//! The arena's part of exporting a block to another process (`Pool::ipc_export`, which
//! checks the pointer first): the block's whole allocations, one shareable descriptor per
//! allocation, and the export record importers check (`crate::share::protocol`,
//! `crate::share::protocol::record`).

use crate::error::{BadPointer, Error, Result};
use crate::pool::Pool;
use crate::share::protocol::ExportRecord;
use crate::share::protocol::{granules_digest, own_start_time, raise_fd_limit, GranuleDescriptor, FileId, SharedGranule};

impl Pool {
    /// The descriptor of the live arena block `(addr, block_size)`, exported at `ptr` for
    /// `size` bytes (`Pool::ipc_export` gives the rest).
    pub(in crate::pool) fn arena_export(&mut self, ptr: usize, size: usize, (addr, block_size): (usize, usize), share_granules: bool, (handover, flags): (u64, u32)) -> Result<Vec<u8>> {
        let g = self.arena_ref().granule();
        // The granules' shareable handles and the record come before the guard that keeps
        // the granules to the block, so a failed export (a driver call, the record) leaves
        // the arena's books as they were: the block stays usable and unguarded. A refused
        // guard ends the record; a granule's descriptor stays with the upstream until the
        // granule is released, and serves its next export.
        // Each exported granule keeps a descriptor open (`crate::share::protocol::fds`).
        raise_fd_limit();
        // Whole allocations: the importer maps a chunk only whole.
        let (first, end) = self.arena_ref().export_extent(ptr, size);
        // Each granule's file identity goes along, so an importer can tell the exported file
        // from whatever its number names later (Note [Sharing between processes], "Trust").
        // (The granules of one allocation share its descriptor: one fstat for them.)
        let mut last: Option<(i32, FileId)> = None;
        // Entries of the device's granularity, which importers map in: a granule larger
        // than that (a tag's, Note [A tag's granule]) is several consecutive ones.
        let listed = self.listed_granule();
        let mut granules = Vec::with_capacity((end - first) / listed);
        for a in (first..end).step_by(g) {
            let s = self.core.upstream_mut().vmm_export(a)?;
            let file = match last {
                Some((fd, file)) if fd == s.fd => file,
                _ => FileId::of(s.fd)?,
            };
            last = Some((s.fd, file));
            granules.extend((0..g / listed).map(|k| SharedGranule { file, offset: s.offset + (k * listed) as u64, ..s }));
        }
        // A block exported before with the same granules keeps its export: one record
        // slot, one descriptor, however often it is sent.
        let digest = granules_digest(&granules);
        let reused = self.exports.reusable(addr, digest);
        let record = match reused {
            Some(at) => at,
            None => ExportRecord::add(&granules)?,
        };
        // The importer maps whole granules: nothing else may live in the block's (unless
        // the caller shares granules, as the framework routes do).
        let mut guarded = if share_granules { Ok(()) } else { self.arena().guard_export(addr, block_size) };
        if guarded.is_err() {
            // Blocks freed into thread caches, or not yet fenced, are live in the books:
            // hand them back and look again.
            self.flush_thread_caches(None);
            self.fence_unfenced();
            self.finish_pending(false);
            guarded = self.arena().guard_export(addr, block_size);
        }
        if let Err(why) = guarded {
            if reused.is_none() {
                ExportRecord::end(record);
            }
            return Err(Error::InvalidPointer { ptr, device: self.core.device(), why: BadPointer::Refused(format!("IPC export: {why}")) });
        }
        if reused.is_none() {
            self.exports.note(addr, record, digest);
        }
        let d = GranuleDescriptor {
            kind: self.core.upstream().vmm_share_kind(),
            pid: std::process::id(),
            start_time: own_start_time(),
            record,
            device: self.core.device(),
            granule: listed as u64,
            offset: (ptr - first) as u64,
            size: size as u64,
            origin: first as u64,
            handover,
            flags,
            granules,
        };
        Ok(d.encode())
    }

    /// How many granules an export of `size` bytes at `ptr` names (`None`: not an arena
    /// pool, whose export is CUDA's segment handle).
    pub(in crate::pool) fn arena_export_granules(&self, ptr: usize, size: usize) -> Option<usize> {
        let a = self.core.arena()?;
        let (first, end) = a.export_extent(ptr, size);
        Some((end - first) / self.listed_granule())
    }

    /// The granule exports list: the device's granularity (the arena's granule where the
    /// upstream does not say).
    fn listed_granule(&self) -> usize {
        let g = self.arena_ref().granule();
        match self.core.upstream().vmm_device_granule() {
            d if d == 0 || d > g || g % d != 0 => g,
            d => d,
        }
    }
}
