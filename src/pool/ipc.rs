//! Sharing blocks with other processes: export a live block as a descriptor, map another
//! process's descriptor, unmap it again. This file checks the pointer against the pool's
//! books and picks what goes: an arena block's granules (`crate::upstream::shared` gives
//! the descriptor and the driver calls: `cudaIpcGetMemHandle` refuses memory of the virtual
//! memory API), or a segment pool's segment handle and offset, through CUDA's own IPC
//! (`crate::upstream::legacy_descriptor`).
//!
//! The contract is CUDA IPC's: the exporter keeps the block allocated while an importer
//! uses it (a freed block's memory goes to the exporter's next allocation), and the
//! importer sees the whole granules under the block, as `cudaIpcOpenMemHandle` shows the
//! whole `cuMemAlloc` allocation.

use super::{Pool, NO_OWNER};
use crate::error::{BadPointer, Error, Result};
use crate::upstream::legacy_descriptor::LegacyDescriptor;
use crate::upstream::export_record::ExportRecord;
use crate::upstream::shared::{granules_digest, raise_fd_limit, own_start_time, Descriptor, FdSource, FileId, SharedGranule, KIND_CUDA};

impl Pool {
    /// The descriptor of the live block at `ptr` (its start, as allocated).
    /// `share_granules`: export a block that shares a granule with other live blocks too,
    /// which the importer can then reach (as CUDA's own IPC shows the whole `cuMemAlloc`
    /// allocation, and PyTorch's the whole segment, other tensors included); the framework
    /// routes (`gpupool.torch`, `gpupool.cupy`) ask for it, as small tensors always share
    /// granules. Without it such a block is refused and free memory in its granules is set
    /// aside while it lives.
    pub fn ipc_export(&mut self, ptr: usize, share_granules: bool) -> Result<Vec<u8>> {
        self.running()?;
        let refuse = |why: String| Error::InvalidPointer { ptr, device: self.core.device, why: BadPointer::Refused(why) };
        let Some(l) = self.core.live.get(&ptr) else {
            let why = match self.classify_bad_pointer(ptr) {
                Error::InvalidPointer { why: BadPointer::Interior { block_start, .. }, .. } => {
                    format!("IPC export: it points inside the block at {block_start:#x}; pass the address malloc returned")
                }
                Error::InvalidPointer { why: BadPointer::AlreadyFreed, .. } => "IPC export: the block was freed".into(),
                _ => "IPC export: not a block gpupool allocated on this device".into(),
            };
            return Err(refuse(why));
        };
        // A block this thread's cache holds as freed is no longer the caller's to share
        // (asked, not claimed: the cache keeps it either way).
        if l.owner != NO_OWNER && self.caches.is_kept(l.owner, ptr) {
            return Err(refuse("IPC export: the block was freed".into()));
        }
        // A block this thread's cache handed out would go back to that cache when freed,
        // never reaching the pool, which must end the export then: it becomes the pool's.
        let owner = l.owner;
        if owner != NO_OWNER && self.caches.claim(owner, ptr).is_some() {
            if let Some(l) = self.core.live.get_mut(&ptr) {
                l.owner = NO_OWNER;
            }
        }
        let Some(l) = self.core.live.get(&ptr) else { return Err(refuse("IPC export: the block was freed".into())) };
        if l.private.is_some() {
            // Graph pools' blocks are segments of their own (`graph_pools.rs`), not granules.
            return Err(refuse(
                "IPC export: the block belongs to a CUDA graph's private pool, whose memory cudaIpcGetMemHandle shares".into(),
            ));
        }
        let size = l.requested.max(1);
        let Some(g) = self.core.strategy.as_arena_ref().map(|a| a.granule()) else {
            // A segment pool's block lies in a `cuMemAlloc` segment: CUDA's own IPC handle
            // of the segment and the block's offset in it.
            let (segment, device) = (l.block.segment, self.core.device);
            let handle = self.core.upstream.legacy_ipc_export(segment).map_err(|e| {
                Error::InvalidArgument(format!(
                    "IPC export of {ptr:#x}: device {device}'s pool is `{}`, whose blocks go through CUDA's IPC handles: {e}",
                    self.core.strategy.name()
                ))
            })?;
            let pid = std::process::id();
            let d = LegacyDescriptor { pid, device, start_time: own_start_time(), handle, offset: (ptr - segment) as u64, size: size as u64 };
            return Ok(d.encode());
        };
        // The granules' shareable handles and the record come before the guard that keeps
        // the granules to the block, so a failed export (a driver call, the record) leaves
        // the arena's books as they were: the block stays usable and unguarded. A refused
        // guard ends the record; a granule's descriptor stays with the upstream until the
        // granule is released, and serves its next export.
        // Each exported granule keeps a descriptor open (`shared.rs`).
        raise_fd_limit();
        let (addr, block_size) = (l.block.addr, l.block.size);
        // Whole allocations: the importer maps a chunk only whole.
        let (first, end) = self.core.strategy.as_arena_ref().expect("arena pool").export_extent(ptr, size);
        // Each granule's file identity goes along, so an importer can tell the exported file
        // from whatever its number names later (`shared.rs`, "Trust").
        // (The granules of one allocation share its descriptor: one fstat for them.)
        let mut last: Option<(i32, FileId)> = None;
        let granules = (first..end)
            .step_by(g)
            .map(|a| {
                let s = self.core.upstream.vmm_export(a)?;
                let file = match last {
                    Some((fd, file)) if fd == s.fd => file,
                    _ => FileId::of(s.fd)?,
                };
                last = Some((s.fd, file));
                Ok(SharedGranule { file, ..s })
            })
            .collect::<Result<Vec<_>>>()?;
        // A block exported before with the same granules keeps its export: one record
        // slot, one descriptor, however often it is sent.
        let digest = granules_digest(&granules);
        let reused = self.core.strategy.as_arena().expect("arena pool").export_of(addr, digest);
        let record = match reused {
            Some(at) => at,
            None => ExportRecord::add(&granules)?,
        };
        // The importer maps whole granules: nothing else may live in the block's (unless
        // the caller shares granules, as the framework routes do).
        let mut guarded = if share_granules { Ok(()) } else { self.arena_guard_export(addr, block_size) };
        if guarded.is_err() {
            // Blocks freed into thread caches, or not yet fenced, are live in the books:
            // hand them back and look again.
            self.flush_thread_caches(None);
            self.fence_unfenced();
            self.finish_pending(false);
            guarded = self.arena_guard_export(addr, block_size);
        }
        if let Err(why) = guarded {
            if reused.is_none() {
                ExportRecord::end(record);
            }
            return Err(Error::InvalidPointer { ptr, device: self.core.device, why: BadPointer::Refused(format!("IPC export: {why}")) });
        }
        if reused.is_none() {
            self.core.strategy.as_arena().expect("arena pool").note_export(addr, record, digest);
        }
        let d = Descriptor {
            kind: self.core.upstream.vmm_share_kind(),
            pid: std::process::id(),
            start_time: own_start_time(),
            record,
            device: self.core.device,
            granule: g as u64,
            offset: (ptr - first) as u64,
            size: size as u64,
            origin: first as u64,
            granules,
        };
        Ok(d.encode())
    }

    /// The length `ipc_export` of the live block at `ptr` would return, exporting nothing
    /// (a pointer that is no live block gets `ipc_export`'s error).
    pub fn ipc_export_len(&mut self, ptr: usize) -> Result<usize> {
        let Some(l) = self.core.live.get(&ptr).filter(|l| l.private.is_none()) else {
            return self.ipc_export(ptr, false).map(|d| d.len());
        };
        let size = l.requested.max(1);
        Ok(match self.core.strategy.as_arena_ref().map(|a| a.granule()) {
            Some(g) => {
                let (first, end) = self.core.strategy.as_arena_ref().expect("arena pool").export_extent(ptr, size);
                let granules = (end - first) / g;
                crate::upstream::shared::HEADER_BYTES + crate::upstream::shared::GRANULE_BYTES * granules
            }
            None => crate::upstream::legacy_descriptor::LEGACY_DESCRIPTOR_BYTES,
        })
    }

    fn arena_guard_export(&mut self, addr: usize, size: usize) -> std::result::Result<(), String> {
        self.core.strategy.as_arena().expect("arena pool").guard_export(addr, size)
    }

    /// Map the block another process exported as `d` (decoded by the caller, before
    /// this pool's lock); returns where it starts here. `fds`: this process's copies of
    /// the exporter's descriptors, one per granule in the descriptor's order or each
    /// exporter number once in the order of its first appearance (`Descriptor::per_granule`);
    /// `None` fetches them from the exporter (`pidfd_getfd`), one at a time.
    ///
    /// Fetched descriptors go through the cache of kept imports (`import_cache.rs`): a block
    /// whose memory is still mapped from an earlier message is served with no driver call.
    pub fn ipc_import(&mut self, d: &Descriptor, fds: Option<&[i32]>) -> Result<usize> {
        if fds.is_some() {
            let source = self.import_source(d, fds)?;
            return self.core.upstream.vmm_import(d, &source);
        }
        self.running()?;
        self.check_kind(d)?;
        let (exporter, serial) = self.imports.exporter(d)?;
        let source = FdSource::fetch_via(exporter.clone(), d)?;
        // Read before anything is mapped: a release after it moves the count past what
        // the run records, and the run is not trusted again.
        let releases = exporter.releases().ok_or_else(|| {
            Error::InvalidArgument(format!("IPC import: the export record of process {} cannot be read", d.pid))
        })?;
        self.drop_kept_imports(false);
        if let Some(ptr) = self.imports.open_kept(d, releases, serial) {
            return Ok(ptr);
        }
        let ptr = self.core.upstream.vmm_import(d, &source)?;
        self.imports.insert(d, ptr, releases, exporter, serial);
        Ok(ptr)
    }

    /// Unmap the idle kept imports that may not serve again (their exporter released
    /// memory or exited, or too many are kept), or all of them (`everything`). A run the
    /// upstream fails to unmap stays kept, to be tried again.
    pub(super) fn drop_kept_imports(&mut self, everything: bool) {
        for key in self.imports.stale(everything) {
            match self.core.upstream.vmm_unimport(key) {
                Ok(_) => self.imports.dropped(key),
                Err(e) => crate::error::warn(&format!("dropping a kept import at {key:#x} failed: {e}; it stays mapped")),
            }
        }
    }

    /// Unmap every idle kept import (the pool is about to be replaced).
    pub fn drop_kept_imports_all(&mut self) {
        self.drop_kept_imports(true);
    }

    /// Idle imports kept mapped for later messages (`import_cache.rs`).
    pub fn ipc_imports_kept(&self) -> usize {
        self.imports.idle()
    }

    /// The checks `ipc_import` makes of `d` and the descriptors `fds` (the memory's kind, a
    /// descriptor for each granule, each the file the exporter shared), mapping nothing: for
    /// a block shown through an import already made (`gpupool_ipc_open_dlpack`).
    pub fn ipc_check(&self, d: &Descriptor, fds: &[i32]) -> Result<()> {
        let source = self.import_source(d, Some(fds))?;
        let Some(fds) = source.given() else {
            return Err(Error::Internal("IPC check: descriptors were given, yet none are".into()));
        };
        let mut last = None;
        for (i, g) in d.granules.iter().enumerate() {
            // A chunk's granules share one descriptor: one check each.
            if last != Some((fds[i], g.fd, g.file)) {
                source.get(i, g)?;
                last = Some((fds[i], g.fd, g.file));
            }
        }
        Ok(())
    }

    fn import_source<'a>(&self, d: &'a Descriptor, fds: Option<&'a [i32]>) -> Result<FdSource<'a>> {
        self.running()?;
        self.check_kind(d)?;
        let source = match fds {
            Some(f) => match d.per_granule(f) {
                Some(given) => FdSource::Given(given),
                None => {
                    return Err(Error::InvalidArgument(format!(
                        "IPC import: {} descriptors passed for a block of {} granules naming {} of the exporter's \
                         (pass one per granule, or each of the exporter's once in the order the descriptor first names it)",
                        f.len(),
                        d.granules.len(),
                        d.granules.iter().map(|g| g.fd).collect::<std::collections::HashSet<_>>().len()
                    )))
                }
            },
            None => FdSource::fetch_from(d)?,
        };
        Ok(source)
    }

    /// The descriptor is of the memory this pool's upstream maps (else: refused, saying so).
    fn check_kind(&self, d: &Descriptor) -> Result<()> {
        let kind = self.core.upstream.vmm_share_kind();
        if d.kind != kind {
            let name = |k| if k == KIND_CUDA { "CUDA device" } else { "host-upstream" };
            return Err(Error::InvalidArgument(format!(
                "IPC import: the descriptor is of {} memory; device {}'s upstream ({}) maps {}",
                name(d.kind),
                self.core.device,
                self.core.upstream.name(),
                if kind == 0 { "none" } else { name(kind) }
            )));
        }
        Ok(())
    }

    /// Map the segment pool's block another process exported as `d` (CUDA's own IPC);
    /// returns where it starts here.
    pub fn ipc_import_legacy(&mut self, d: &LegacyDescriptor) -> Result<usize> {
        self.running()?;
        self.core.upstream.legacy_ipc_open(&d.handle, d.offset as usize)
    }

    /// Unmap what `ipc_import` returned as `ptr` (that address exactly).
    pub fn ipc_close(&mut self, ptr: usize) -> Result<()> {
        if let Some(idle) = self.imports.close(ptr) {
            // Kept mapped for the exporter's next message; what may not serve again goes.
            if idle {
                self.drop_kept_imports(false);
            }
            return Ok(());
        }
        if self.imports.covers(ptr) {
            // A kept run's address no block is open at any more: closed already. The
            // upstream must not unmap it behind the cache's books.
            let why = BadPointer::Refused("IPC close: the block at this address was closed already".into());
            return Err(Error::InvalidPointer { ptr, device: self.core.device, why });
        }
        if self.core.upstream.vmm_unimport(ptr)? || self.core.upstream.legacy_ipc_close(ptr)? {
            return Ok(());
        }
        let why = BadPointer::Refused("IPC close: not an address gpupool_ipc_open returned on this device".into());
        Err(Error::InvalidPointer { ptr, device: self.core.device, why })
    }

    /// How many blocks of other processes this pool has mapped (`ipc_import`).
    pub fn ipc_imports(&self) -> usize {
        // The upstream's imports count the cache's runs, which count once per open block.
        (self.core.upstream.vmm_imports() + self.imports.opens() + self.core.upstream.legacy_ipc_imports()).saturating_sub(self.imports.runs())
    }
}
