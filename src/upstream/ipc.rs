//! The sharing concern of an upstream: exporting memory to another process and mapping
//! another process's memory, as arena granules (shareable handles, `share::protocol`) or as
//! whole allocations of segment pools (CUDA IPC handles). By default an upstream shares
//! nothing: exports and imports are refused with the reason, and closes find nothing to
//! close (`Ok(false)`).

use super::Memory;
use crate::share::protocol::{FdSource, GranuleDescriptor, SharedGranule};
use crate::error::{Error, Result};

/// Memory shared between processes (module docs).
pub trait Ipc: Memory {
    /// Which IPC descriptors this upstream exports and imports (`share::protocol::KIND_*`; 0: none).
    fn vmm_share_kind(&self) -> u32 {
        0
    }
    /// The shareable handle of the physical granule mapped at `addr` (a home or an alias),
    /// for another process to map (`share::protocol::granule_descriptor`). It stays valid while the granule is mapped.
    fn vmm_export(&mut self, _addr: usize) -> Result<SharedGranule> {
        Err(Error::InvalidArgument("this upstream's memory cannot be shared with other processes".into()))
    }
    /// Map the granules of another process's block `d` side by side in a new address
    /// range, readable and writable by the device (and its peers); returns the block's
    /// address in it (the range's base + `d.offset`). `fds` yields this process's copy of
    /// each granule's descriptor, one at a time. All or nothing.
    fn vmm_import(&mut self, _d: &GranuleDescriptor, _fds: &FdSource) -> Result<usize> {
        Err(Error::InvalidArgument("this upstream cannot map memory of other processes".into()))
    }
    /// Unmap the range `vmm_import` returned `ptr` for (exactly that address; the
    /// exporter's memory is untouched). `Ok(false)`: `ptr` is no such address.
    fn vmm_unimport(&mut self, _ptr: usize) -> Result<bool> {
        Ok(false)
    }
    /// How many imported ranges are mapped (a pool with any is not idle).
    fn vmm_imports(&self) -> usize {
        0
    }
    /// Address space those imported ranges hold.
    fn vmm_import_bytes(&self) -> usize {
        0
    }
    /// The CUDA IPC handle (`cuIpcGetMemHandle`) of the allocation holding `ptr` (memory
    /// from `allocate`): how segment pools' blocks go to another process.
    fn cuda_ipc_export(&mut self, _ptr: usize) -> Result<[u8; 64]> {
        Err(Error::InvalidArgument(format!("IPC export: the {} upstream's memory cannot be shared with other processes", self.name())))
    }
    /// Map another process's allocation `handle` (once per process: later opens are
    /// counted) and return `offset` into it.
    fn cuda_ipc_open(&mut self, _handle: &[u8; 64], _offset: usize) -> Result<usize> {
        Err(Error::InvalidArgument(format!("IPC import: the {} upstream cannot map CUDA IPC handles", self.name())))
    }
    /// Undo one `cuda_ipc_open` that returned `ptr`; `Ok(false)`: it returned no such.
    fn cuda_ipc_close(&mut self, _ptr: usize) -> Result<bool> {
        Ok(false)
    }
    /// Opens of `cuda_ipc_open` outstanding.
    fn cuda_ipc_imports(&self) -> usize {
        0
    }
}
