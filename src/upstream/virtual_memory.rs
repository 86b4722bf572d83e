//! The virtual memory concern of an upstream: address ranges reserved with nothing
//! behind them, physical allocations mapped into them and aliased at second addresses
//! (the arena's granules, stitches and loans), and a tag's pause and resume
//! (`docs/tags.md`). Upstreams without the driver's virtual memory management keep the
//! defaults (`vmm_granule() == 0`), and the arena falls back.

use super::{AliasFail, AllocError, EventHandle, Memory, UnmapFail};
use crate::error::{Error, Result};

/// Virtual memory management (module docs).
pub trait VirtualMemory: Memory {
    /// Granularity of the virtual memory API (the arena's granule, a power of two), or 0
    /// when this upstream or device has none. May ask the driver once.
    fn vmm_granule(&mut self) -> usize {
        0
    }
    /// Make the granule (each allocation `vmm_map_new` creates, and the alignment of what
    /// is reserved) `bytes`: a power-of-two multiple of the device's granularity, larger
    /// allocations for fewer driver calls per byte (a tag's memory, Note [A tag's
    /// granule]). Only before anything is reserved; returns the granule in use (the
    /// device's where `bytes` is not such a multiple, or the upstream keeps its own).
    fn vmm_set_granule(&mut self, _bytes: usize) -> usize {
        self.vmm_granule()
    }
    /// The device's granularity: what exports list their memory in, whatever the granule,
    /// so that every importer (whose granule is the device's) maps them. 0: the granule.
    fn vmm_device_granule(&self) -> usize {
        0
    }
    /// Reserve `len` (granule multiple) bytes of address space, nothing mapped.
    fn vmm_reserve(&mut self, _len: usize) -> Result<usize> {
        Err(Error::Internal("this upstream has no virtual memory API".into()))
    }
    /// Give back an address range from `vmm_reserve` (everything in it unmapped).
    fn vmm_unreserve(&mut self, _base: usize, _len: usize) -> Result<()> {
        Err(Error::Internal("this upstream has no virtual memory API".into()))
    }
    /// Back the unmapped granules of `[addr, addr + len)` with new physical memory, readable
    /// and writable by the device (and its peers). All or nothing.
    fn vmm_map_new(&mut self, _addr: usize, _len: usize) -> std::result::Result<(), AllocError> {
        Err(AllocError::Other(Error::Internal("this upstream has no virtual memory API".into())))
    }
    /// Back the unmapped granules of `[addr, addr + len)` with one new physical allocation
    /// (a chunk): one create, one map and one access grant for all of it. The driver maps,
    /// unmaps and exports an allocation only whole, so the pool aliases, releases and
    /// exports a chunk only whole. An upstream without such allocations maps granule by
    /// granule (the same books, more calls). All or nothing.
    fn vmm_map_chunk(&mut self, addr: usize, len: usize) -> std::result::Result<(), AllocError> {
        self.vmm_map_new(addr, len)
    }
    /// Unmap the allocations of `[addr, addr + len)` (whole ones) in order and release
    /// their physical memory. A failure says how much is unmapped all the same
    /// (`UnmapFail`): an allocation whose unmap succeeded and whose release failed is
    /// unmapped (and its memory leaked), not still mapped. The pool calls it one allocation
    /// at a time.
    fn vmm_unmap(&mut self, _addr: usize, _len: usize) -> std::result::Result<(), UnmapFail> {
        Err(UnmapFail::nothing(Error::Internal("this upstream has no virtual memory API".into())))
    }
    /// Map the physical memory of the granules mapped at `homes` side by side from the
    /// unmapped granule `to` on as well (aliases: both addresses show the same bytes),
    /// without allocating. `homes` lists whole allocations (a chunk's granules in order from
    /// its first): one map per allocation. One access grant covers them all. A failure
    /// says how many granules are aliased (whole allocations), for the caller to remove.
    fn vmm_alias(&mut self, _homes: &[usize], _to: usize) -> std::result::Result<(), AliasFail> {
        Err(AliasFail { made: 0, error: Error::Internal("this upstream has no virtual memory API".into()) })
    }
    /// Remove the aliases of `[addr, addr + len)`, whole alias mappings (their memory stays
    /// at its home).
    fn vmm_unalias(&mut self, _addr: usize, _len: usize) -> Result<()> {
        Err(Error::Internal("this upstream has no virtual memory API".into()))
    }

    /// What the granules `vmm_map_new` creates are, for the reports: the shareable handle
    /// kinds (`posix_fd`, `fabric`, both joined by `+`, or `none`), `+gpudirect_rdma` where
    /// they are created RDMA-capable. Empty where this upstream has no VMM.
    fn vmm_memory_kind(&self) -> String {
        String::new()
    }
    /// Pause every allocation this upstream maps for the arena (`docs/tags.md`): where
    /// `backup`, copy the contents to host memory; unmap them (homes and aliases) and
    /// release their physical memory, keeping the address ranges reserved. `after`: an
    /// event the copies (or the unmaps) wait for first. Returns the bytes released.
    fn vmm_pause(&mut self, _after: Option<EventHandle>, _backup: bool) -> Result<usize> {
        Err(Error::InvalidArgument(format!(
            "the {} upstream cannot pause memory: pausing needs the arena over the virtual memory API",
            self.name()
        )))
    }
    /// Make the host buffer a pause with a backup copies into now, as large as what is
    /// mapped (page-locking gigabytes takes seconds, which the first pause would otherwise
    /// pay); it is kept, as after a pause, until `vmm_drop_backup`. Returns its bytes.
    fn vmm_prepare_backup(&mut self) -> Result<usize> {
        Ok(0)
    }
    /// Map new memory where `vmm_pause` released it, at the same addresses, and copy the
    /// backup back. All or nothing: refused, the memory stays paused. Returns the bytes.
    fn vmm_resume(&mut self) -> std::result::Result<usize, AllocError> {
        Ok(0)
    }
    /// Bytes paused and not resumed.
    fn vmm_paused_bytes(&self) -> usize {
        0
    }
    /// Whether a pause is on record (it may hold no bytes: a pause that failed midway
    /// after unmapping aliases only), which only `vmm_resume` ends.
    fn vmm_is_paused(&self) -> bool {
        false
    }
    /// Give back the host memory kept for the next pause's backup; returns its bytes.
    fn vmm_drop_backup(&mut self) -> usize {
        0
    }
    /// Let device `peer` access this upstream's memory from now on, granting it what is
    /// mapped now (Note [Peer access on demand] in `upstream/peers.rs`); returns the grants
    /// made. Upstreams without peers grant nothing.
    fn vmm_enable_peer(&mut self, _peer: i32) -> Result<usize> {
        Ok(0)
    }
}
