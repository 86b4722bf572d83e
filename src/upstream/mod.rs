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
//!
//! The interface is one trait per concern, each with defaults for upstreams without it:
//! `Memory` (here), `VirtualMemory`, `Ipc` and `Events`. `Upstream` is all four.

pub mod calls;
pub mod capture_routes;
pub mod cuda;
pub mod events;
pub mod host;
pub mod host_vmm;
pub mod ipc;
pub mod make;
pub mod peers;
pub mod sim;
pub mod stream_id;
pub mod virtual_memory;

pub use calls::DriverCalls;
pub use events::Events;
pub use ipc::Ipc;
pub use virtual_memory::VirtualMemory;

use crate::error::{Error, Result};
use stream_id::StreamHandle;

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

/// Why `VirtualMemory::vmm_alias` failed: the error, and how many of the aliases asked for
/// (the first `made`) are in place all the same, which the caller removes (`vmm_unalias`).
#[derive(Debug)]
pub struct AliasFail {
    pub made: usize,
    pub error: Error,
}

/// Why `VirtualMemory::vmm_unmap` or `Memory::decommit` failed, and what is unmapped all the
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

/// Memory: whole segments from the driver (or the host) and back, the pages inside them,
/// and the count of driver calls. Every upstream has it; the other concerns
/// (`VirtualMemory`, `Ipc`, `Events`) keep defaults for upstreams without them.
pub trait Memory: Send {
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

    /// Driver calls made so far, by kind.
    fn driver_calls(&self) -> DriverCalls {
        DriverCalls::default()
    }
}

/// An upstream: every concern together, what a pool holds (`Box<dyn Upstream>`). Each
/// concern is its own trait so an upstream (or a test's stand-in) writes only the ones it
/// has; this trait is implemented for every type that has all four.
pub trait Upstream: Memory + VirtualMemory + Ipc + Events {}

impl<T: Memory + VirtualMemory + Ipc + Events + ?Sized> Upstream for T {}

