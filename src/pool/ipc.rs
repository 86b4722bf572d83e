//! The pool's hooks for sharing blocks with other processes (Note [Sharing between
//! processes]): export a live block as a descriptor, map another process's descriptor,
//! unmap it again. For an export this file checks the pointer against the pool's books and
//! picks what goes: an arena block's granules, since `cudaIpcGetMemHandle` refuses memory
//! of the virtual memory API (`arena/export.rs` lists them, this file writes the record
//! and guards the block), or a segment pool's segment handle and
//! offset, through CUDA's own IPC (`crate::share::protocol::segment_descriptor`). For
//! imports it lends its kept imports and its upstream to `crate::share::imports::Importer`,
//! which decides the calls.
//!
//! The contract is CUDA IPC's: the exporter keeps the block allocated while an importer
//! uses it (a freed block's memory goes to the exporter's next allocation), and the
//! importer sees the whole granules under the block, as `cudaIpcOpenMemHandle` shows the
//! whole `cuMemAlloc` allocation.

use super::{WordState, Pool, NO_OWNER};
use crate::error::{BadPointer, Error, Result};
use crate::share::protocol::SegmentDescriptor;
use crate::share::imports::Importer;
use crate::share::protocol::{granules_digest, own_start_time, ExportRecord, GranuleDescriptor};
use super::arena::export;

impl Pool {
    /// The descriptor of the live block at `ptr` (its start, as allocated).
    /// `share_granules`: export a block that shares a granule with other live blocks too,
    /// which the importer can then reach (as CUDA's own IPC shows the whole `cuMemAlloc`
    /// allocation, and PyTorch's the whole segment, other tensors included); the framework
    /// routes (`gpupool.torch`, `gpupool.cupy`) ask for it, as small tensors always share
    /// granules. Without it such a block is refused and free memory in its granules is set
    /// aside while it lives.
    pub fn ipc_export(&mut self, ptr: usize, share_granules: bool) -> Result<Vec<u8>> {
        self.ipc_export_via(ptr, share_granules, 0, 0)
    }

    /// `ipc_export`, naming in an arena block's descriptor `handover`, the random part of
    /// this process's handover socket name (`share::handover`: an importer that may not
    /// copy this process's descriptors asks for them there), and `flags`
    /// (`protocol::FLAG_*`).
    pub(crate) fn ipc_export_via(&mut self, ptr: usize, share_granules: bool, handover: u64, flags: u32) -> Result<Vec<u8>> {
        self.running()?;
        self.not_paused()?;
        let device = self.core.device();
        let refuse = |why: String| Error::InvalidPointer { ptr, device, why: BadPointer::Refused(why) };
        let Some(l) = self.core.live(ptr) else {
            let why = match self.classify_bad_pointer(ptr) {
                Error::InvalidPointer { why: BadPointer::Interior { block_start, .. }, .. } => {
                    format!("IPC export: it points inside the block at {block_start:#x}; pass the address malloc returned")
                }
                Error::InvalidPointer { why: BadPointer::AlreadyFreed, .. } => "IPC export: the block was freed".into(),
                _ => "IPC export: not a block gpupool allocated on this device".into(),
            };
            return Err(refuse(why));
        };
        // A block its thread's cache handed out would go back to that cache when freed,
        // never reaching the pool, which must end the export then: it becomes the pool's.
        // The claim and the owner's fast-path free race on one word; whichever comes
        // second sees the other's mark, so a block kept as freed is refused here (and
        // stays the cache's), never exported.
        let owner = l.owner;
        if owner != NO_OWNER {
            match self.caches.claim(owner, ptr) {
                Some(WordState::Handed) => {
                    if let Some(l) = self.core.live_mut(ptr) {
                        l.owner = NO_OWNER;
                    }
                }
                Some(_) => return Err(refuse("IPC export: the block was freed".into())),
                None => {}
            }
        }
        let Some(l) = self.core.live(ptr) else { return Err(refuse("IPC export: the block was freed".into())) };
        if l.private.is_some() {
            // Graph pools' blocks are segments of their own (`graph_pools.rs`), not granules.
            return Err(refuse(
                "IPC export: the block belongs to a CUDA graph's private pool, whose memory cudaIpcGetMemHandle shares".into(),
            ));
        }
        let size = l.requested.max(1);
        if !self.core.is_arena() {
            // A segment pool's block lies in a `cuMemAlloc` segment: CUDA's own IPC handle
            // of the segment and the block's offset in it.
            let (segment, device) = (l.block.segment, self.core.device());
            let handle = self.core.upstream_mut().cuda_ipc_export(segment).map_err(|e| {
                Error::InvalidArgument(format!(
                    "IPC export of {ptr:#x}: device {device}'s pool is `{}`, whose blocks go through CUDA's IPC handles: {e}",
                    self.core.strategy().name()
                ))
            })?;
            let pid = std::process::id();
            let d = SegmentDescriptor { pid, device, start_time: own_start_time(), handle, offset: (ptr - segment) as u64, size: size as u64 };
            return Ok(d.encode());
        }
        let (addr, block_size) = (l.block.addr, l.block.size);
        self.arena_export(ptr, size, (addr, block_size), share_granules, (handover, flags))
    }

    /// The descriptor of the live arena block `(addr, block_size)`, exported at `ptr` for
    /// `size` bytes: its granules (`arena/export.rs`), the export record importers check,
    /// and the guard that keeps the granules to the block.
    fn arena_export(&mut self, ptr: usize, size: usize, (addr, block_size): (usize, usize), share_granules: bool, (handover, flags): (u64, u32)) -> Result<Vec<u8>> {
        // The granules' shareable handles and the record come before the guard, so a failed
        // export (a driver call, the record) leaves the arena's books as they were: the
        // block stays usable and unguarded. A refused guard ends the record.
        let (first, listed, granules) = export::granules(&mut self.core, ptr, size)?;
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

    /// The length `ipc_export` of the live block at `ptr` would return, exporting nothing
    /// (a pointer that is no live block gets `ipc_export`'s error).
    pub(crate) fn ipc_export_len(&mut self, ptr: usize) -> Result<usize> {
        let Some(l) = self.core.live(ptr).filter(|l| l.private.is_none()) else {
            return self.ipc_export(ptr, false).map(|d| d.len());
        };
        let size = l.requested.max(1);
        Ok(match export::granule_count(&self.core, ptr, size) {
            Some(granules) => crate::share::protocol::HEADER_BYTES + crate::share::protocol::GRANULE_BYTES * granules,
            None => crate::share::protocol::SEGMENT_DESCRIPTOR_BYTES,
        })
    }

    /// This pool's imports of other processes' memory, for one call: map, check, close,
    /// count (`crate::share::imports::Importer`). A stopped pool maps nothing more and still
    /// unmaps.
    pub fn importer(&mut self) -> Importer<'_> {
        let (stopped, device) = (self.running().err(), self.core.device());
        Importer::new(&mut self.imports, self.core.upstream_mut(), device, stopped)
    }
}
