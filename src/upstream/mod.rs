//! Upstreams: where raw memory comes from. An upstream never caches; the pool does.
//!
//! Contract every implementation keeps (the pool relies on each point):
//! - `allocate(size, stream)` returns an address aligned to at least `MIN_ALIGN` (256 B)
//!   for `size > 0`, or `AllocError::OutOfMemory` when the device/capacity is exhausted
//!   (the pool then releases cached memory and retries), or `AllocError::Other` for any
//!   other failure (reported as is, no retry).
//! - `deallocate(addr, size, stream)` receives exactly an `(addr, size)` pair that
//!   `allocate` returned; `stream` is the stream whose work last touched it. A
//!   stream-ordered upstream frees on that stream; the others may assume the pool
//!   synchronised that stream first.
//! - `mem_info()` gives device `(free, total)` bytes, for percentage limits and reports.
//! - The stream/event methods map 1:1 to the CUDA driver's; upstreams without streams
//!   (host) keep the defaults, in which every event is complete at once.
//! - Page-mapped upstreams (`page_size() > 0`: `vmm`, `host`, the simulated device) can
//!   `decommit` whole pages inside a segment, keeping the addresses reserved, and
//!   `commit` them again. The pool calls `decommit` only on pages of free blocks whose
//!   streams it synchronised, and `commit` before handing such pages out; `deallocate`
//!   of a segment with decommitted pages releases what is still committed. A failed
//!   `decommit` says how many pages from its start went back all the same (`UnmapFail`),
//!   and the pool books exactly those as decommitted; a failed `commit` backs nothing.
//! - Upstreams with the virtual memory management API (`vmm_granule() > 0`: CUDA devices
//!   that support it, `host`, the simulated device) serve the `arena` strategy: they reserve
//!   address ranges with nothing behind them, map physical granules into them, map a
//!   granule's physical memory at a second address (an alias) and release it. Addresses
//!   passed are granule aligned and inside a reservation; the pool never maps a mapped
//!   granule, removes a granule's aliases before unmapping it, and unmaps only granules no
//!   queued work touches (it synchronised their streams).
//! - Every upstream counts the driver calls it makes (`driver_calls`).
//! - Every method is called with the pool's lock held, from any thread.

pub mod calls;
pub mod cuda;
pub mod export_record;
pub mod host;
pub mod host_vmm;
pub mod legacy_descriptor;
pub mod shared;
pub mod sim;
pub mod stream_id;

pub use calls::DriverCalls;

use crate::error::{Error, Result};
use stream_id::{StreamHandle, StreamKey};

/// Every address an upstream hands out is a multiple of this, and so is every block the
/// pool hands out (CUDA's own allocation granule is 256 B; `cuMemAlloc` guarantees it).
pub const MIN_ALIGN: usize = 256;

/// An opaque event (a `CUevent` for the CUDA upstreams).
pub type EventHandle = usize;

/// Why an upstream allocation failed.
#[derive(Debug)]
pub enum AllocError {
    /// The device (or simulated capacity) has no room: release cache and retry.
    OutOfMemory,
    /// Anything else: reported to the caller as is.
    Other(Error),
}

/// Why `Upstream::vmm_alias` failed: the error, and how many of the aliases asked for
/// (the first `made`) are in place all the same, which the caller removes (`vmm_unalias`).
#[derive(Debug)]
pub struct AliasFail {
    pub made: usize,
    pub error: Error,
}

/// Why `Upstream::vmm_unmap` or `Upstream::decommit` failed, and what is unmapped all the
/// same: the pool books exactly the granules (pages) whose addresses are gone as unmapped
/// (decommitted), so it never hands out an address with nothing behind it, and never maps
/// over one still mapped.
#[derive(Debug)]
pub struct UnmapFail {
    /// Bytes from `addr` on whose addresses are unmapped (free to map again): the granules
    /// before the one that failed, and that one too where only the release of its physical
    /// memory failed. Those after it are mapped as before.
    pub unmapped: usize,
    /// Of those, bytes whose physical memory could not be released: no address shows it any
    /// more, so the pool cannot use it again, and the driver may still count it.
    pub leaked: usize,
    pub error: Error,
}

impl UnmapFail {
    /// A failure before anything was unmapped.
    pub fn nothing(error: Error) -> UnmapFail {
        UnmapFail { unmapped: 0, leaked: 0, error }
    }
}

impl From<Error> for AllocError {
    fn from(e: Error) -> Self {
        AllocError::Other(e)
    }
}

pub trait Upstream: Send {
    /// Short name used in reports (`device`, `vmm`, `managed`, `async`, `host`, `pinned`).
    fn name(&self) -> &'static str;

    /// True when `deallocate` is ordered on the stream (the `async` upstream), so the pool
    /// need not synchronise before releasing.
    fn stream_ordered(&self) -> bool {
        false
    }

    fn allocate(&mut self, size: usize, stream: StreamHandle) -> std::result::Result<usize, AllocError>;

    fn deallocate(&mut self, addr: usize, size: usize, stream: StreamHandle) -> Result<()>;

    /// `(free, total)` bytes of the device behind this upstream.
    fn mem_info(&mut self) -> Result<(usize, usize)>;

    /// Granularity of `commit` / `decommit` (a power of two), or 0 when whole segments are
    /// the only unit this upstream can give back.
    fn page_size(&self) -> usize {
        0
    }
    /// Back the page-aligned range `[addr, addr + len)` of a segment with memory again.
    /// All or nothing.
    fn commit(&mut self, _addr: usize, _len: usize) -> std::result::Result<(), AllocError> {
        Err(AllocError::Other(Error::Internal("this upstream cannot commit pages".into())))
    }
    /// Give back the memory of the page-aligned range `[addr, addr + len)` of a segment,
    /// keeping the addresses, page by page in order. No queued work may touch it. A failure
    /// stops at the page that failed and says how much went back all the same
    /// (`UnmapFail`): those pages have no memory behind them, the rest keep theirs.
    fn decommit(&mut self, _addr: usize, _len: usize) -> std::result::Result<(), UnmapFail> {
        Err(UnmapFail::nothing(Error::Internal("this upstream cannot decommit pages".into())))
    }

    /// Granularity of the virtual memory API (the arena's granule, a power of two), or 0
    /// when this upstream or device has none. May ask the driver once.
    fn vmm_granule(&mut self) -> usize {
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

    /// Which IPC descriptors this upstream exports and imports (`shared::KIND_*`; 0: none).
    fn vmm_share_kind(&self) -> u32 {
        0
    }
    /// The shareable handle of the physical granule mapped at `addr` (a home or an alias),
    /// for another process to map (`shared.rs`). It stays valid while the granule is mapped.
    fn vmm_export(&mut self, _addr: usize) -> Result<shared::SharedGranule> {
        Err(Error::InvalidArgument("this upstream's memory cannot be shared with other processes".into()))
    }
    /// Map the granules of another process's block `d` side by side in a new address
    /// range, readable and writable by the device (and its peers); returns the block's
    /// address in it (the range's base + `d.offset`). `fds` yields this process's copy of
    /// each granule's descriptor, one at a time. All or nothing.
    fn vmm_import(&mut self, _d: &shared::Descriptor, _fds: &shared::FdSource) -> Result<usize> {
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
    /// The CUDA IPC handle (`cuIpcGetMemHandle`) of the allocation holding `ptr` (memory
    /// from `allocate`): how segment pools' blocks go to another process.
    fn legacy_ipc_export(&mut self, _ptr: usize) -> Result<[u8; 64]> {
        Err(Error::InvalidArgument(format!("IPC export: the {} upstream's memory cannot be shared with other processes", self.name())))
    }
    /// Map another process's allocation `handle` (once per process: later opens are
    /// counted) and return `offset` into it.
    fn legacy_ipc_open(&mut self, _handle: &[u8; 64], _offset: usize) -> Result<usize> {
        Err(Error::InvalidArgument(format!("IPC import: the {} upstream cannot map CUDA IPC handles", self.name())))
    }
    /// Undo one `legacy_ipc_open` that returned `ptr`; `Ok(false)`: it returned no such.
    fn legacy_ipc_close(&mut self, _ptr: usize) -> Result<bool> {
        Ok(false)
    }
    /// Opens of `legacy_ipc_open` outstanding.
    fn legacy_ipc_imports(&self) -> usize {
        0
    }

    /// Driver calls made so far, by kind.
    fn driver_calls(&self) -> DriverCalls {
        DriverCalls::default()
    }

    /// Identity of a non-legacy stream handle.
    fn stream_key(&mut self, handle: StreamHandle) -> Result<StreamKey> {
        Ok(StreamKey(handle as u64))
    }

    fn event_create(&mut self) -> Result<EventHandle> {
        Ok(0)
    }
    fn event_destroy(&mut self, _ev: EventHandle) {}
    fn event_record(&mut self, _ev: EventHandle, _stream: StreamHandle) -> Result<()> {
        Ok(())
    }
    /// True when all work captured by the event's last record has completed.
    fn event_query(&mut self, _ev: EventHandle) -> Result<bool> {
        Ok(true)
    }
    fn event_synchronize(&mut self, _ev: EventHandle) -> Result<()> {
        Ok(())
    }
    fn stream_wait_event(&mut self, _stream: StreamHandle, _ev: EventHandle) -> Result<()> {
        Ok(())
    }

    /// The id of the CUDA graph capture `stream` takes part in, or `None` when it is not
    /// capturing (`cuStreamGetCaptureInfo`). Upstreams without streams never capture.
    fn capture_id(&mut self, _stream: StreamHandle) -> Result<Option<u64>> {
        Ok(None)
    }
    /// While `on`, make every driver call in relaxed stream-capture mode
    /// (`cuThreadExchangeStreamCaptureMode`), so that a graph captured in global mode on any
    /// thread is not invalidated by the pool's own calls (PyTorch does the same around its
    /// `cudaMalloc`). The pool turns it on while private pools route allocations.
    fn set_capture_relaxed(&mut self, _on: bool) {}
    /// Wait until every stream of the device is idle. Used once when a private (graph) pool
    /// is destroyed: a graph may have been launched on any stream, so no one event covers
    /// its work.
    fn synchronize_device(&mut self) -> Result<()> {
        Ok(())
    }
}

/// Build the upstream for `device`. CUDA kinds check for the driver first and validate the
/// device id; `host` accepts ids `0..MAX_DEVICES` (simulated devices of `host_capacity`).
pub fn build(kind: crate::config::UpstreamKind, device: i32, host_capacity: usize) -> Result<Box<dyn Upstream>> {
    use crate::config::UpstreamKind as K;
    use cuda::CudaUpstream;
    // Only here, where a device pool is being made, is the host upstream an alternative.
    let hint = |e: Error| match e {
        Error::NoDriver(m) => Error::NoDriver(format!("{m}; without a GPU, GPUPOOL_UPSTREAM=host runs the pool on host memory")),
        other => other,
    };
    Ok(match kind {
        K::Host => Box::new(host::HostUpstream::for_device(host_capacity, device)),
        K::Device => Box::new(CudaUpstream::new(device, cuda::device::DeviceMem).map_err(hint)?),
        K::Managed => Box::new(CudaUpstream::new(device, cuda::managed::ManagedMem).map_err(hint)?),
        K::Async => Box::new(CudaUpstream::new(device, cuda::async_::AsyncMem).map_err(hint)?),
        K::Vmm => Box::new(CudaUpstream::new(device, cuda::vmm::VmmMem::new()).map_err(hint)?),
    })
}

/// The page-locked host upstream of the pinned pool (events live in device 0's context).
pub fn build_pinned() -> Result<Box<dyn Upstream>> {
    Ok(Box::new(cuda::CudaUpstream::new(0, cuda::pinned::PinnedMem)?))
}
