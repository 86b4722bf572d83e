//! Sharing arena blocks with other processes: export a live block as a descriptor, map
//! another process's descriptor, unmap it again. The descriptor's format and the driver
//! calls are the upstream's (`crate::upstream::shared`); this file checks the pointer
//! against the pool's books and picks the granules under the block.
//!
//! Why only the arena: `split` and the others hand out `cuMemAlloc` memory, which
//! `cudaIpcGetMemHandle` shares already (CuPy, PyTorch and C programs use it as is); the
//! arena's memory comes from the virtual memory API, which that call refuses.
//!
//! The contract is CUDA IPC's: the exporter keeps the block allocated while an importer
//! uses it (a freed block's memory goes to the exporter's next allocation), and the
//! importer sees the whole granules under the block, as `cudaIpcOpenMemHandle` shows the
//! whole `cuMemAlloc` allocation.

use super::{Hold, Pool, NO_OWNER};
use crate::error::{BadPointer, Error, Result};
use crate::upstream::shared::{fetch_fds, raise_fd_limit, Descriptor, KIND_CUDA};

impl Pool {
    /// The descriptor of the live block at `ptr` (its start, as allocated).
    pub fn ipc_export(&mut self, ptr: usize) -> Result<Vec<u8>> {
        self.running()?;
        let Some(l) = self.live.get(&ptr) else {
            return Err(self.classify_bad_pointer(ptr));
        };
        let size = l.requested.max(1);
        // A block this thread's cache holds as freed is no longer the caller's to share.
        if l.owner != NO_OWNER && self.caches.claim(l.owner, ptr).is_some_and(|h| h != Hold::Handed) {
            return Err(Error::InvalidPointer { ptr, device: self.device, why: BadPointer::AlreadyFreed });
        }
        let Some(g) = self.strategy.as_arena_ref().map(|a| a.granule()) else {
            return Err(Error::InvalidArgument(format!(
                "IPC export of {ptr:#x}: device {}'s pool is `{}`, whose memory cudaIpcGetMemHandle shares; \
                 gpupool_ipc_export serves GPUPOOL_POOL=arena memory",
                self.device,
                self.strategy.name()
            )));
        };
        raise_fd_limit();
        let first = ptr & !(g - 1);
        let end = (ptr + size).div_ceil(g) * g;
        let granules = (first..end).step_by(g).map(|a| self.upstream.vmm_export(a)).collect::<Result<Vec<_>>>()?;
        let d = Descriptor {
            kind: self.upstream.vmm_share_kind(),
            pid: std::process::id(),
            device: self.device,
            granule: g as u64,
            offset: (ptr - first) as u64,
            size: size as u64,
            granules,
        };
        Ok(d.encode())
    }

    /// Map the block another process exported as `bytes`; returns where it starts here.
    /// `fds`: this process's copies of the exporter's descriptors, one per granule in the
    /// descriptor's order; `None` fetches them from the exporter (`pidfd_getfd`).
    pub fn ipc_import(&mut self, bytes: &[u8], fds: Option<&[i32]>) -> Result<usize> {
        self.running()?;
        let d = Descriptor::decode(bytes)?;
        let kind = self.upstream.vmm_share_kind();
        if d.kind != kind {
            let name = |k| if k == KIND_CUDA { "CUDA device" } else { "host-upstream" };
            return Err(Error::InvalidArgument(format!(
                "IPC import: the descriptor is of {} memory; device {}'s upstream ({}) maps {}",
                name(d.kind),
                self.device,
                self.upstream.name(),
                if kind == 0 { "none" } else { name(kind) }
            )));
        }
        let fetched;
        let fds = match fds {
            Some(f) if f.len() == d.granules.len() => f,
            Some(f) => {
                return Err(Error::InvalidArgument(format!(
                    "IPC import: {} descriptors passed for a block of {} granules",
                    f.len(),
                    d.granules.len()
                )))
            }
            None => {
                fetched = fetch_fds(d.pid, &d.granules.iter().map(|g| g.fd).collect::<Vec<_>>())?;
                &fetched.0[..]
            }
        };
        // Fetched descriptors close when `fetched` drops: the mappings keep the memory.
        let base = self.upstream.vmm_import(&d.granules, fds, d.granule as usize)?;
        Ok(base + d.offset as usize)
    }

    /// Unmap what `ipc_import` returned as `ptr`.
    pub fn ipc_close(&mut self, ptr: usize) -> Result<()> {
        self.upstream.vmm_unimport(ptr).map_err(|e| match e {
            Error::Internal(_) => Error::InvalidPointer { ptr, device: self.device, why: BadPointer::Unknown },
            e => e,
        })
    }
}
