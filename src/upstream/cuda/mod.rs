//! CUDA upstreams through cudarc's driver API (dynamically loaded; no link-time libcuda).
//!
//! One generic `CudaUpstream<K>` implements the `Upstream` contract (contexts, streams,
//! events, memory info); each memory kind is one file implementing `MemKind`:
//! `device.rs` (cuMemAlloc), `managed.rs` (cuMemAllocManaged), `async_.rs`
//! (cuMemAllocAsync, stream-ordered), `vmm.rs` (page-mapped, pages can be given back inside
//! a segment) and `pinned.rs` (cuMemHostAlloc, page-locked host). `address_space.rs` is the
//! virtual memory API of the `arena` strategy, available beside any kind on devices that
//! support it. Every driver call is counted (`DriverCalls`).

pub mod address_space;
pub mod async_;
pub mod device;
pub mod driver;
pub mod ipc_handles;
pub mod managed;
pub mod pinned;
pub mod vmm;

use super::{AliasFail, AllocError, DriverCalls, EventHandle, Events, Ipc, Memory, UnmapFail, VirtualMemory};
use address_space::CudaVmm;
use crate::error::Result;
use crate::upstream::stream_id::{StreamHandle, StreamKey};
use cudarc::driver::sys;
use driver::{check, PrimaryContext};

/// How one kind of CUDA memory is obtained and released. Called with the device's primary
/// context current.
pub trait MemKind: Send {
    const NAME: &'static str;
    /// The driver call behind `obtain`, for error messages.
    const ALLOC_CALL: &'static str;
    /// Whether `release` is ordered on the stream (no synchronisation needed before it).
    const STREAM_ORDERED: bool = false;
    /// Returns the driver's status; `CUDA_ERROR_OUT_OF_MEMORY` means "release cache, retry".
    fn obtain(&mut self, size: usize, stream: sys::CUstream) -> std::result::Result<usize, sys::CUresult>;
    fn release(&mut self, addr: usize, stream: sys::CUstream) -> Result<()>;
    /// Called once with the context current, before any other call.
    fn init(&mut self, _device: sys::CUdevice) -> Result<()> {
        Ok(())
    }
    /// Page granularity of `commit` / `decommit`; 0 = not page-mapped.
    fn page_size(&self) -> usize {
        0
    }
    fn commit(&mut self, _addr: usize, _len: usize) -> std::result::Result<(), sys::CUresult> {
        Err(sys::CUresult::CUDA_ERROR_NOT_SUPPORTED)
    }
    /// Give back the memory of the pages of `[addr, addr + len)` in order; a failure says
    /// how much went back all the same (`Memory::decommit`).
    fn decommit(&mut self, _addr: usize, _len: usize) -> std::result::Result<(), UnmapFail> {
        Err(UnmapFail::nothing(driver::cuda_error("decommit", sys::CUresult::CUDA_ERROR_NOT_SUPPORTED)))
    }
    /// `(free, total)` of the memory this kind draws on.
    fn mem_info(&mut self) -> Result<(usize, usize)> {
        let (mut free, mut total) = (0usize, 0usize);
        check("cuMemGetInfo", unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) })?;
        Ok((free, total))
    }
}

pub struct CudaUpstream<K: MemKind> {
    ctx: PrimaryContext,
    kind: K,
    /// The arena's virtual memory API: probed on first use; `Some(None)`: not supported.
    vmm: Option<Option<CudaVmm>>,
    calls: DriverCalls,
    /// Make calls in relaxed capture mode (`Events::set_capture_relaxed`).
    relaxed: bool,
    /// Other processes' `cuMemAlloc` allocations mapped here (`cuda_ipc_open`).
    ipc_handle_imports: ipc_handles::IpcHandleImports,
    /// The device's ordinal (`capture_routes` counts by it).
    ordinal: i32,
}

// SAFETY: the context and event handles are plain driver handles, valid from any thread;
// every use pushes the primary context first.
unsafe impl<K: MemKind> Send for CudaUpstream<K> {}

impl<K: MemKind> CudaUpstream<K> {
    pub fn new(device: i32, kind: K) -> Result<Self> {
        let mut up = CudaUpstream { ctx: PrimaryContext::retain(device)?, kind, vmm: None, calls: DriverCalls::default(), relaxed: false, ipc_handle_imports: Default::default(), ordinal: device };
        {
            let _g = up.ctx.enter()?;
            up.kind.init(up.ctx.device)?;
        }
        Ok(up)
    }
}

impl<K: MemKind> CudaUpstream<K> {
    /// Make the device's context current (and, while private pools route allocations on
    /// the device, in any of its pools, this thread's capture mode relaxed) for the
    /// duration of one driver call.
    fn enter(&self) -> Result<(driver::RelaxedCapture, driver::CtxGuard)> {
        let g = self.ctx.enter()?;
        let relaxed = self.relaxed || crate::upstream::capture_routes::active(self.ordinal);
        Ok((driver::RelaxedCapture::enter(relaxed), g))
    }

    /// The probed VMM API and the call counters (separate borrows of self).
    fn vmm_parts(&mut self) -> Result<(&mut CudaVmm, &mut DriverCalls)> {
        match self.vmm.as_mut().and_then(|v| v.as_mut()) {
            Some(v) => Ok((v, &mut self.calls)),
            None => Err(crate::error::Error::Internal("arena: this device has no virtual memory API".into())),
        }
    }
}

fn stream_ptr(h: StreamHandle) -> sys::CUstream {
    h as sys::CUstream
}

impl<K: MemKind> Memory for CudaUpstream<K> {
    fn name(&self) -> &'static str {
        K::NAME
    }

    fn stream_ordered(&self) -> bool {
        K::STREAM_ORDERED
    }

    fn allocate(&mut self, size: usize, stream: StreamHandle) -> std::result::Result<usize, AllocError> {
        let _g = self.enter()?;
        self.calls.malloc += 1;
        match self.kind.obtain(size, stream_ptr(stream)) {
            Ok(p) => Ok(p),
            Err(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY) => {
                // The failed call leaves a "sticky" last error in the runtime for some
                // versions; the driver API does not. Nothing to clear.
                Err(AllocError::OutOfMemory)
            }
            Err(code) => Err(AllocError::Other(driver::cuda_error(K::ALLOC_CALL, code))),
        }
    }

    fn deallocate(&mut self, addr: usize, _size: usize, stream: StreamHandle) -> Result<()> {
        let _g = self.enter()?;
        self.calls.free += 1;
        self.kind.release(addr, stream_ptr(stream))
    }

    fn mem_info(&mut self) -> Result<(usize, usize)> {
        let _g = self.enter()?;
        self.kind.mem_info()
    }

    fn page_size(&self) -> usize {
        self.kind.page_size()
    }

    fn commit(&mut self, addr: usize, len: usize) -> std::result::Result<(), AllocError> {
        let _g = self.enter()?;
        self.calls.mem_map += 1;
        match self.kind.commit(addr, len) {
            Ok(()) => Ok(()),
            Err(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY) => Err(AllocError::OutOfMemory),
            Err(code) => Err(AllocError::Other(driver::cuda_error("cuMemCreate/cuMemMap", code))),
        }
    }

    fn decommit(&mut self, addr: usize, len: usize) -> std::result::Result<(), UnmapFail> {
        let _g = self.enter().map_err(UnmapFail::nothing)?;
        self.calls.mem_unmap += 1;
        self.kind.decommit(addr, len)
    }

    fn driver_calls(&self) -> DriverCalls {
        self.calls
    }
}

impl<K: MemKind> VirtualMemory for CudaUpstream<K> {
    fn vmm_granule(&mut self) -> usize {
        if self.vmm.is_none() {
            // A device without VMM (or a failing probe) gets no arena: the pool falls back.
            let probed = self.ctx.enter().ok().and_then(|_g| CudaVmm::new(self.ctx.device).ok().flatten());
            self.vmm = Some(probed);
        }
        self.vmm.as_ref().and_then(|v| v.as_ref()).map_or(0, |v| v.granule())
    }

    fn vmm_set_granule(&mut self, bytes: usize) -> usize {
        let _ = self.vmm_granule();
        self.vmm.as_mut().and_then(|v| v.as_mut()).map_or(0, |v| v.set_granule(bytes))
    }

    fn vmm_device_granule(&self) -> usize {
        self.vmm.as_ref().and_then(|v| v.as_ref()).map_or(0, |v| v.device_granule())
    }

    fn vmm_reserve(&mut self, len: usize) -> Result<usize> {
        let _g = self.enter()?;
        let (vmm, calls) = self.vmm_parts()?;
        vmm.reserve(len, calls)
    }

    fn vmm_unreserve(&mut self, base: usize, len: usize) -> Result<()> {
        let _g = self.enter()?;
        let (vmm, calls) = self.vmm_parts()?;
        vmm.unreserve(base, len, calls)
    }

    fn vmm_map_new(&mut self, addr: usize, len: usize) -> std::result::Result<(), AllocError> {
        let _g = self.enter()?;
        let (vmm, calls) = self.vmm_parts()?;
        vmm.map_new(addr, len, calls)
    }

    fn vmm_map_chunk(&mut self, addr: usize, len: usize) -> std::result::Result<(), AllocError> {
        let _g = self.enter()?;
        let (vmm, calls) = self.vmm_parts()?;
        vmm.map_chunk(addr, len, calls)
    }

    fn vmm_unmap(&mut self, addr: usize, len: usize) -> std::result::Result<(), UnmapFail> {
        let _g = self.enter().map_err(UnmapFail::nothing)?;
        let (vmm, calls) = self.vmm_parts().map_err(UnmapFail::nothing)?;
        vmm.unmap(addr, len, calls)
    }

    fn vmm_alias(&mut self, homes: &[usize], to: usize) -> std::result::Result<(), AliasFail> {
        let no_alias = |error| AliasFail { made: 0, error };
        let _g = self.enter().map_err(no_alias)?;
        let (vmm, calls) = self.vmm_parts().map_err(no_alias)?;
        vmm.alias(homes, to, calls)
    }

    fn vmm_unalias(&mut self, addr: usize, len: usize) -> Result<()> {
        let _g = self.enter()?;
        let (vmm, calls) = self.vmm_parts()?;
        vmm.unalias(addr, len, calls)
    }

    fn vmm_pause(&mut self, after: Option<EventHandle>, backup: bool) -> Result<usize> {
        let _g = self.enter()?;
        let (vmm, calls) = self.vmm_parts()?;
        vmm.pause(after, backup, calls)
    }

    fn vmm_resume(&mut self) -> std::result::Result<usize, AllocError> {
        let _g = self.enter()?;
        let (vmm, calls) = self.vmm_parts()?;
        vmm.resume(calls)
    }

    fn vmm_paused_bytes(&self) -> usize {
        self.vmm.as_ref().and_then(|v| v.as_ref()).map_or(0, |v| v.paused_bytes())
    }

    fn vmm_is_paused(&self) -> bool {
        self.vmm.as_ref().and_then(|v| v.as_ref()).is_some_and(|v| v.is_paused())
    }

    fn vmm_prepare_backup(&mut self) -> Result<usize> {
        let _g = self.enter()?;
        let (vmm, calls) = self.vmm_parts()?;
        vmm.prepare_backup(calls)
    }

    fn vmm_enable_peer(&mut self, peer: i32) -> Result<usize> {
        if self.vmm.as_ref().and_then(|v| v.as_ref()).is_none() {
            return Ok(0); // no arena here: `cuMemAlloc` memory needs no grant
        }
        let _g = self.enter()?;
        let (vmm, calls) = self.vmm_parts()?;
        vmm.enable_peer(peer, calls)
    }

    fn vmm_drop_backup(&mut self) -> usize {
        let Ok(_g) = self.enter() else { return 0 };
        self.vmm.as_mut().and_then(|v| v.as_mut()).map_or(0, |v| v.drop_backup())
    }

    fn vmm_memory_kind(&self) -> String {
        self.vmm.as_ref().and_then(|v| v.as_ref()).map_or_else(String::new, |v| v.memory_kind())
    }
}

impl<K: MemKind> Ipc for CudaUpstream<K> {
    fn vmm_share_kind(&self) -> u32 {
        crate::share::protocol::KIND_CUDA
    }

    fn vmm_export(&mut self, addr: usize) -> Result<crate::share::protocol::SharedGranule> {
        let _g = self.enter()?;
        let (vmm, calls) = self.vmm_parts()?;
        vmm.export(addr, calls)
    }

    fn vmm_import(&mut self, d: &crate::share::protocol::GranuleDescriptor, fds: &crate::share::protocol::FdSource) -> Result<usize> {
        if self.vmm_granule() == 0 {
            return Err(crate::error::Error::InvalidArgument(
                "IPC import: this device has no virtual memory management".into(),
            ));
        }
        let _g = self.enter()?;
        let (vmm, calls) = self.vmm_parts()?;
        vmm.import(d, fds, calls)
    }

    fn vmm_unimport(&mut self, ptr: usize) -> Result<bool> {
        if self.vmm_imports() == 0 {
            return Ok(false);
        }
        let _g = self.enter()?;
        let (vmm, calls) = self.vmm_parts()?;
        vmm.unimport(ptr, calls)
    }

    fn vmm_imports(&self) -> usize {
        self.vmm.as_ref().and_then(|v| v.as_ref()).map_or(0, |v| v.imports())
    }

    fn vmm_import_bytes(&self) -> usize {
        self.vmm.as_ref().and_then(|v| v.as_ref()).map_or(0, |v| v.import_bytes())
    }

    fn cuda_ipc_export(&mut self, ptr: usize) -> Result<[u8; 64]> {
        let _g = self.enter()?;
        ipc_handles::export(ptr, &mut self.calls)
    }

    fn cuda_ipc_open(&mut self, handle: &[u8; 64], offset: usize) -> Result<usize> {
        let _g = self.enter()?;
        self.ipc_handle_imports.open(handle, offset, &mut self.calls)
    }

    fn cuda_ipc_close(&mut self, ptr: usize) -> Result<bool> {
        if !self.ipc_handle_imports.is_open(ptr) {
            return Ok(false);
        }
        let _g = self.enter()?;
        // Kernels this process queued on the block may still read or write it, and once
        // this returns the sender may free and reuse it (its hold, or PyTorch's reference
        // count, goes back next), whether or not the allocation stays mapped for other opens.
        // The block's streams are not known here: the device's work is waited for, as an
        // arena import's close does.
        self.calls.event_sync += 1;
        let waited = check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() });
        // Closed whether or not the wait succeeded (a sticky error, a capture in progress):
        // a failed wait must not leave the mapping booked open for good. Its error is the
        // caller's to report.
        let closed = self.ipc_handle_imports.close(ptr, &mut self.calls);
        waited.and(closed)
    }

    fn cuda_ipc_imports(&self) -> usize {
        self.ipc_handle_imports.count()
    }
}

impl<K: MemKind> Events for CudaUpstream<K> {
    fn stream_key(&mut self, handle: StreamHandle) -> Result<StreamKey> {
        let _g = self.enter()?;
        self.calls.stream_id += 1;
        let mut id: std::ffi::c_ulonglong = 0;
        check("cuStreamGetId", unsafe { sys::cuStreamGetId(stream_ptr(handle), &mut id) })?;
        Ok(StreamKey(id as u64))
    }

    fn event_create(&mut self) -> Result<EventHandle> {
        let _g = self.enter()?;
        let mut ev: sys::CUevent = std::ptr::null_mut();
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut ev, sys::CUevent_flags_enum::CU_EVENT_DISABLE_TIMING as u32)
        })?;
        Ok(ev as usize)
    }

    fn event_destroy(&mut self, ev: EventHandle) {
        if let Ok(_g) = self.enter() {
            unsafe { sys::cuEventDestroy_v2(ev as sys::CUevent) };
        }
    }

    fn event_record(&mut self, ev: EventHandle, stream: StreamHandle) -> Result<()> {
        let _g = self.enter()?;
        self.calls.event_record += 1;
        check("cuEventRecord", unsafe { sys::cuEventRecord(ev as sys::CUevent, stream_ptr(stream)) })
    }

    fn event_query(&mut self, ev: EventHandle) -> Result<bool> {
        let _g = self.enter()?;
        self.calls.event_query += 1;
        match unsafe { sys::cuEventQuery(ev as sys::CUevent) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            code => Err(driver::cuda_error("cuEventQuery", code)),
        }
    }

    fn event_synchronize(&mut self, ev: EventHandle) -> Result<()> {
        let _g = self.enter()?;
        self.calls.event_sync += 1;
        check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(ev as sys::CUevent) })
    }

    fn stream_wait_event(&mut self, stream: StreamHandle, ev: EventHandle) -> Result<()> {
        let _g = self.enter()?;
        self.calls.stream_wait += 1;
        check("cuStreamWaitEvent", unsafe { sys::cuStreamWaitEvent(stream_ptr(stream), ev as sys::CUevent, 0) })
    }

    fn capture_id(&mut self, stream: StreamHandle) -> Result<Option<u64>> {
        if crate::upstream::stream_id::is_legacy(stream) {
            return Ok(None); // the legacy stream cannot capture
        }
        let _g = self.enter()?;
        self.calls.capture_info += 1;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let mut id: sys::cuuint64_t = 0;
        use std::ptr::null_mut;
        // SAFETY: the optional outputs (graph, dependencies, edges) are NULL, which the
        // driver accepts; the others are writable locals.
        check("cuStreamGetCaptureInfo", unsafe {
            sys::cuStreamGetCaptureInfo_v3(stream_ptr(stream), &mut status, &mut id, null_mut(), null_mut(), null_mut(), null_mut())
        })?;
        Ok(match status {
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => None,
            // Active, or invalidated (still a capture sequence: its memory must stay out of
            // eager use until the user ends it).
            _ => Some(id as u64),
        })
    }

    fn set_capture_relaxed(&mut self, on: bool) {
        self.relaxed = on;
    }

    fn synchronize_device(&mut self) -> Result<()> {
        let _g = self.enter()?;
        self.calls.event_sync += 1;
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }
}
