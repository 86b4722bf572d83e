//! The driver's virtual memory management API for the `arena` strategy: address ranges
//! reserved once (`cuMemAddressReserve`), physical granules created (`cuMemCreate`) and
//! mapped into them (`cuMemMap` + `cuMemSetAccess`), mapped at a second address (an alias:
//! the same handle mapped again, how the arena stitches scattered granules into one range),
//! and released (`cuMemUnmap` + `cuMemRelease`).
//!
//! Access is granted to the owning device and to every device that can access it as a
//! peer, so peer copies and NCCL over NVLink see arena memory as they see `cuMemAlloc`
//! memory. Called with the device's primary context current (`CudaUpstream` does that).
//!
//! Granules are created shareable as POSIX file descriptors where the device supports it,
//! so another process can map them (`crate::upstream::shared`): `export` hands out a
//! granule's descriptor, kept open until the granule is released, and `import` maps another
//! process's granules side by side in a range of this process. Where the device also
//! reports fabric handles (multi-node NVLink), both kinds are asked for at once (as
//! NCCL's `cuMemCreate` with fabric does), so fds keep working for `export`. A driver that refuses a kind of shareable allocation (some
//! containers; fabric handles without an IMEX channel) gets the next plainer one from then
//! on: fd + fabric, then fd, then none; only export fails then, with a message saying so.
//!
//! Where the device reports GPUDirect RDMA with VMM memory, granules are created
//! `gpuDirectRDMACapable`, so NCCL over InfiniBand (and other RDMA users) can register
//! arena memory as it registers `cuMemAlloc` memory.

use super::driver::{check, cuda_error};
use crate::error::{Error, Result};
use crate::upstream::shared::{new_fd_cloexec, Descriptor, FdSource, SharedGranule};
use crate::upstream::{AliasFail, AllocError, DriverCalls, UnmapFail};
use cudarc::driver::sys;
use rustc_hash::FxHashMap;

/// Device memory of `device`, as `cuMemCreate` takes it.
pub fn device_prop(device: sys::CUdevice) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct for which all-zero is the documented default.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    prop
}

/// The allocation granularity of `prop` (`MINIMUM` or `RECOMMENDED`), checked to be a power
/// of two.
pub fn granularity(prop: &sys::CUmemAllocationProp, which: sys::CUmemAllocationGranularity_flags) -> Result<usize> {
    let mut g = 0usize;
    check("cuMemGetAllocationGranularity", unsafe { sys::cuMemGetAllocationGranularity(&mut g, prop, which) })?;
    if !g.is_power_of_two() {
        return Err(Error::Internal(format!("device allocation granularity {g} is not a power of two")));
    }
    Ok(g)
}

pub struct CudaVmm {
    prop: sys::CUmemAllocationProp,
    granule: usize,
    /// Who may read and write arena memory: the device, then its peers.
    access: Vec<sys::CUmemAccessDesc>,
    /// Physical allocation mapped at each granule address.
    handles: FxHashMap<usize, sys::CUmemGenericAllocationHandle>,
    /// Alias address -> the home granule (a key of `handles`) whose memory it shows.
    aliases: FxHashMap<usize, usize>,
    /// Home granule -> the file descriptor it was exported as (closed at its release).
    exported: FxHashMap<usize, i32>,
    /// Ranges mapping another process's granules (`import`): base -> (length, the
    /// address `import` returned, which alone closes it, bytes from the base already
    /// unmapped by a close the driver failed midway: a retry resumes there).
    imports: FxHashMap<usize, (usize, usize, usize)>,
}

const POSIX_FD: sys::CUmemAllocationHandleType = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
const FABRIC: sys::CUmemAllocationHandleType = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC;
const NO_HANDLE_TYPE: sys::CUmemAllocationHandleType = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;

/// `a | b` of two handle-type flags (the driver takes a bit set).
fn both(a: sys::CUmemAllocationHandleType, b: sys::CUmemAllocationHandleType) -> sys::CUmemAllocationHandleType {
    sys::CUmemAllocationHandleType(a.0 | b.0)
}

/// The next plainer request after `t` was refused: fabric goes first, then fds.
fn plainer(t: sys::CUmemAllocationHandleType) -> sys::CUmemAllocationHandleType {
    if t.0 & FABRIC.0 != 0 && t.0 & POSIX_FD.0 != 0 {
        POSIX_FD
    } else {
        NO_HANDLE_TYPE
    }
}

/// Whether `device` reports attribute `a` as non-zero (a failing query counts as no).
fn attribute(device: sys::CUdevice, a: sys::CUdevice_attribute) -> bool {
    let mut v = 0;
    let r = unsafe { sys::cuDeviceGetAttribute(&mut v, a, device) };
    r == sys::CUresult::CUDA_SUCCESS && v != 0
}

// SAFETY: plain driver handles, valid from any thread.
unsafe impl Send for CudaVmm {}

impl CudaVmm {
    /// The device's VMM support, or `None` when it has none.
    pub fn new(device: sys::CUdevice) -> Result<Option<CudaVmm>> {
        let mut supported = 0;
        check("cuDeviceGetAttribute", unsafe {
            sys::cuDeviceGetAttribute(
                &mut supported,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
                device,
            )
        })?;
        if supported == 0 {
            return Ok(None);
        }
        let mut prop = device_prop(device);
        use sys::CUdevice_attribute as A;
        if attribute(device, A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED) {
            prop.requestedHandleTypes = POSIX_FD;
            if attribute(device, A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED) {
                prop.requestedHandleTypes = both(POSIX_FD, FABRIC);
            }
        }
        if attribute(device, A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED) {
            prop.allocFlags.gpuDirectRDMACapable = 1;
        }
        // The granule of plain device memory: the shareable kinds and the RDMA flag asked
        // for above do not change it, and a query that refused them would hide the VMM.
        let g = granularity(&device_prop(device), sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)?;
        let rw = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        let mut access = vec![sys::CUmemAccessDesc { location: prop.location, flags: rw }];
        let mut n = 0;
        check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
        for peer in (0..n).filter(|&d| d != device) {
            let mut can = 0;
            if unsafe { sys::cuDeviceCanAccessPeer(&mut can, peer, device) } == sys::CUresult::CUDA_SUCCESS && can != 0 {
                let mut loc = prop.location;
                loc.id = peer;
                access.push(sys::CUmemAccessDesc { location: loc, flags: rw });
            }
        }
        Ok(Some(CudaVmm {
            prop,
            granule: g,
            access,
            handles: FxHashMap::default(),
            aliases: FxHashMap::default(),
            exported: FxHashMap::default(),
            imports: FxHashMap::default(),
        }))
    }

    pub fn granule(&self) -> usize {
        self.granule
    }

    /// What granules are created as now (`Upstream::vmm_memory_kind`).
    pub fn memory_kind(&self) -> String {
        let t = self.prop.requestedHandleTypes.0;
        let handles = match (t & POSIX_FD.0 != 0, t & FABRIC.0 != 0) {
            (true, true) => "posix_fd+fabric",
            (true, false) => "posix_fd",
            (false, true) => "fabric",
            (false, false) => "none",
        };
        let rdma = if self.prop.allocFlags.gpuDirectRDMACapable != 0 { "+gpudirect_rdma" } else { "" };
        format!("{handles}{rdma}")
    }

    pub fn reserve(&mut self, len: usize, calls: &mut DriverCalls) -> Result<usize> {
        let mut base: sys::CUdeviceptr = 0;
        calls.address_reserve += 1;
        check("cuMemAddressReserve", unsafe { sys::cuMemAddressReserve(&mut base, len, self.granule, 0, 0) })?;
        Ok(base as usize)
    }

    pub fn unreserve(&mut self, base: usize, len: usize, calls: &mut DriverCalls) -> Result<()> {
        calls.address_free += 1;
        check("cuMemAddressFree", unsafe { sys::cuMemAddressFree(base as sys::CUdeviceptr, len) })
    }

    /// One `cuMemSetAccess` of `[addr, addr + len)` for the first `who` entries of the
    /// access list (1: the device alone).
    fn grant(&self, addr: usize, len: usize, who: usize, calls: &mut DriverCalls) -> sys::CUresult {
        calls.set_access += 1;
        unsafe { sys::cuMemSetAccess(addr as sys::CUdeviceptr, len, self.access.as_ptr(), who) }
    }

    /// Grant access to `[addr, addr + len)`. A peer the driver refuses (peer access not
    /// possible after all) is dropped for good and the grant retried for the device alone.
    fn set_access(&mut self, addr: usize, len: usize, calls: &mut DriverCalls) -> sys::CUresult {
        let r = self.grant(addr, len, self.access.len(), calls);
        if r == sys::CUresult::CUDA_SUCCESS || self.access.len() == 1 {
            return r;
        }
        self.access.truncate(1);
        self.grant(addr, len, 1, calls)
    }

    pub fn map_new(&mut self, addr: usize, len: usize, calls: &mut DriverCalls) -> std::result::Result<(), AllocError> {
        let g = self.granule;
        let mut done = 0;
        let mut failure = None;
        while done < len {
            let p = addr + done;
            if self.handles.contains_key(&p) {
                // Left mapped by the undo of an earlier failed map (below), which the pool
                // booked as unmapped: its memory serves as new memory here.
                done += g;
                continue;
            }
            let mut h: sys::CUmemGenericAllocationHandle = 0;
            calls.mem_create += 1;
            let mut r = unsafe { sys::cuMemCreate(&mut h, g, &self.prop, 0) };
            // A kind of memory the driver refuses (not for lack of memory: no IMEX channel
            // for fabric handles, a container without fd export, no RDMA with VMM) steps
            // down for good: fd + fabric, then fd, then plain, then without the RDMA flag.
            // Other failures (a context error) leave the request as it is.
            use sys::CUresult as R;
            while matches!(r, R::CUDA_ERROR_NOT_PERMITTED | R::CUDA_ERROR_NOT_SUPPORTED | R::CUDA_ERROR_INVALID_VALUE) {
                if self.prop.requestedHandleTypes != NO_HANDLE_TYPE {
                    self.prop.requestedHandleTypes = plainer(self.prop.requestedHandleTypes);
                } else if self.prop.allocFlags.gpuDirectRDMACapable != 0 {
                    self.prop.allocFlags.gpuDirectRDMACapable = 0;
                } else {
                    break;
                }
                calls.mem_create += 1;
                r = unsafe { sys::cuMemCreate(&mut h, g, &self.prop, 0) };
            }
            if r != sys::CUresult::CUDA_SUCCESS {
                failure = Some(("cuMemCreate", r));
                break;
            }
            calls.mem_map += 1;
            let r = unsafe { sys::cuMemMap(p as sys::CUdeviceptr, g, 0, h, 0) };
            if r != sys::CUresult::CUDA_SUCCESS {
                calls.mem_release += 1;
                unsafe { sys::cuMemRelease(h) };
                failure = Some(("cuMemMap", r));
                break;
            }
            self.handles.insert(p, h);
            done += g;
        }
        if failure.is_none() {
            let r = self.set_access(addr, len, calls);
            if r != sys::CUresult::CUDA_SUCCESS {
                failure = Some(("cuMemSetAccess", r));
            }
        }
        match failure {
            None => Ok(()),
            Some((call, r)) => {
                // All or nothing: undo every granule mapped here. One the driver will not
                // unmap stays in `handles`, for the next map of its address to take as is.
                for p in (addr..addr + done).step_by(g) {
                    let _ = self.unmap(p, g, calls);
                }
                if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                    Err(AllocError::OutOfMemory)
                } else {
                    Err(AllocError::Other(cuda_error(call, r)))
                }
            }
        }
    }

    /// Unmap and release granule by granule, stopping at the first failure. A granule the
    /// driver will not unmap stays mapped (and in `handles`): the granules before it are
    /// gone. One whose unmap succeeded but whose release failed is gone too (its address is
    /// free, and the next map there must not find it in `handles`): the failure says so,
    /// and its physical memory is leaked.
    pub fn unmap(&mut self, addr: usize, len: usize, calls: &mut DriverCalls) -> std::result::Result<(), UnmapFail> {
        for p in (addr..addr + len).step_by(self.granule) {
            let before = p - addr;
            let Some(&h) = self.handles.get(&p) else {
                let error = Error::Internal(format!("arena: unmap of {p:#x}, which is not mapped"));
                return Err(UnmapFail { unmapped: before, leaked: 0, error });
            };
            calls.mem_unmap += 1;
            check("cuMemUnmap", unsafe { sys::cuMemUnmap(p as sys::CUdeviceptr, self.granule) })
                .map_err(|error| UnmapFail { unmapped: before, leaked: 0, error })?;
            self.handles.remove(&p);
            if let Some(fd) = self.exported.remove(&p) {
                // Exports of it end before its descriptor number can be reused.
                crate::upstream::export_record::ExportRecord::granule_released(fd, 0);
                // SAFETY: the descriptor `export` got for this granule, ours to close.
                unsafe { libc::close(fd) };
            }
            calls.mem_release += 1;
            check("cuMemRelease", unsafe { sys::cuMemRelease(h) })
                .map_err(|error| UnmapFail { unmapped: before + self.granule, leaked: self.granule, error })?;
        }
        Ok(())
    }

    /// Map the handles behind the granules at `homes` side by side from `to` on as well,
    /// then grant access to the whole run in one call (the driver grants access over a
    /// range of separate mappings). On failure the first `made` aliases are in place and
    /// the caller removes them: a failed grant leaves all of them mapped.
    pub fn alias(&mut self, homes: &[usize], to: usize, calls: &mut DriverCalls) -> std::result::Result<(), AliasFail> {
        let g = self.granule;
        for (i, &home) in homes.iter().enumerate() {
            let Some(&h) = self.handles.get(&home) else {
                let error = Error::Internal(format!("arena: alias of {home:#x}, which is not mapped"));
                return Err(AliasFail { made: i, error });
            };
            calls.mem_map += 1;
            let at = to + i * g;
            check("cuMemMap", unsafe { sys::cuMemMap(at as sys::CUdeviceptr, g, 0, h, 0) })
                .map_err(|error| AliasFail { made: i, error })?;
            self.aliases.insert(at, home);
        }
        let r = self.set_access(to, homes.len() * g, calls);
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(AliasFail { made: homes.len(), error: cuda_error("cuMemSetAccess", r) });
        }
        Ok(())
    }

    /// Unmap the aliases of `[addr, addr + len)`; the memory stays mapped at its home.
    /// One call per granule: each alias is its own mapping, and the driver unmaps whole
    /// mappings only.
    pub fn unalias(&mut self, addr: usize, len: usize, calls: &mut DriverCalls) -> Result<()> {
        let mut first_err = None;
        for p in (addr..addr + len).step_by(self.granule) {
            calls.mem_unmap += 1;
            match check("cuMemUnmap", unsafe { sys::cuMemUnmap(p as sys::CUdeviceptr, self.granule) }) {
                Ok(()) => {
                    self.aliases.remove(&p);
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// The shareable descriptor of the granule mapped at `addr` (a home or an alias),
    /// exported once and kept open until that granule is released.
    pub fn export(&mut self, addr: usize, calls: &mut DriverCalls) -> Result<SharedGranule> {
        let home = self.aliases.get(&addr).copied().unwrap_or(addr);
        let Some(&h) = self.handles.get(&home) else {
            return Err(Error::Internal(format!("arena: export of {addr:#x}, which is not mapped")));
        };
        if let Some(&fd) = self.exported.get(&home) {
            return Ok(SharedGranule { fd, offset: 0, ..Default::default() });
        }
        calls.shareable += 1;
        // The driver's descriptor comes without close-on-exec: it is marked so before a
        // fork() in another thread can copy it into a child (`new_fd_cloexec`).
        let made = new_fd_cloexec(|| {
            let mut fd: libc::c_int = -1;
            let r = unsafe { sys::cuMemExportToShareableHandle((&mut fd as *mut libc::c_int).cast(), h, POSIX_FD, 0) };
            if r == sys::CUresult::CUDA_SUCCESS {
                Ok(fd)
            } else {
                Err(r)
            }
        });
        let fd = made.map_err(|r| {
            let why = if self.prop.requestedHandleTypes == NO_HANDLE_TYPE {
                "; this device or driver gave the arena no shareable memory"
            } else {
                ""
            };
            Error::InvalidArgument(format!("{}{why}", cuda_error("cuMemExportToShareableHandle", r)))
        })?;
        self.exported.insert(home, fd);
        Ok(SharedGranule { fd, offset: 0, ..Default::default() })
    }

    /// Map the granules of `d` (each a whole allocation, behind the descriptors `fds`
    /// yields) side by side in a new range, readable and writable by the device and its
    /// peers; returns the block's address there. All or nothing.
    pub fn import(&mut self, d: &Descriptor, fds: &FdSource, calls: &mut DriverCalls) -> Result<usize> {
        let granule = self.granule;
        if d.granule != granule as u64 {
            return Err(Error::InvalidArgument(format!(
                "IPC import: the exporter's granule is {} bytes, this device's {granule}",
                d.granule
            )));
        }
        if let Some(i) = d.granules.iter().position(|g| g.offset != 0) {
            return Err(Error::InvalidArgument(format!("IPC import: granule {i} has an offset; device granules are whole allocations")));
        }
        let len = d.granules.len() * granule;
        let base = self.reserve(len, calls)?;
        let mut mapped = 0;
        let result = (|| {
            for (i, shared) in d.granules.iter().enumerate() {
                // A fetched descriptor closes at the end of this turn: the mapping keeps the memory.
                let (fd, _fetched) = fds.get(i, shared)?;
                let mut h: sys::CUmemGenericAllocationHandle = 0;
                calls.shareable += 1;
                check("cuMemImportFromShareableHandle", unsafe {
                    sys::cuMemImportFromShareableHandle(&mut h, fd as usize as *mut std::ffi::c_void, POSIX_FD)
                })?;
                calls.mem_map += 1;
                let r = check("cuMemMap", unsafe { sys::cuMemMap((base + mapped * granule) as sys::CUdeviceptr, granule, 0, h, 0) });
                // The mapping keeps the memory; the handle is not needed past it.
                calls.mem_release += 1;
                unsafe { sys::cuMemRelease(h) };
                r?;
                mapped += 1;
            }
            self.grant_import(base, len, calls)
        })();
        if let Err(e) = result {
            // A driver that fails the import and then the unmap has lost the range either
            // way: the import's error is the one returned, the lost range is said once.
            match self.unmap_imported(base, mapped * granule, calls) {
                Ok(()) => {
                    let _ = self.unreserve(base, len, calls);
                }
                Err((_, undo)) => crate::error::warn(&format!(
                    "IPC import failed ({e}) and undoing it failed too ({undo}): {len} bytes of address space at {base:#x} \
                     stay mapped to the exporter's memory until this process ends"
                )),
            }
            return Err(e);
        }
        let ptr = base + d.offset as usize;
        self.imports.insert(base, (len, ptr, 0));
        Ok(ptr)
    }

    /// Grant an imported range to the device and its peers, or to the device alone where
    /// a peer is refused. Unlike `set_access` the peer list stays as it is: a refusal for
    /// another process's memory says nothing about this arena's own.
    fn grant_import(&self, base: usize, len: usize, calls: &mut DriverCalls) -> Result<()> {
        let r = self.grant(base, len, self.access.len(), calls);
        if r == sys::CUresult::CUDA_SUCCESS || self.access.len() == 1 {
            return check("cuMemSetAccess", r);
        }
        check("cuMemSetAccess", self.grant(base, len, 1, calls))
    }

    /// Unmap the range `import` returned `ptr` for and give its address space back.
    /// `Ok(false)`: `ptr` is no such address. On a driver failure the range stays
    /// recorded (and the pool busy), so nothing is forgotten while still mapped, and a
    /// retry resumes at the granule that failed.
    pub fn unimport(&mut self, ptr: usize, calls: &mut DriverCalls) -> Result<bool> {
        let base = ptr & !(self.granule - 1);
        let Some(&(len, returned, done)) = self.imports.get(&base) else { return Ok(false) };
        if returned != ptr {
            return Ok(false);
        }
        // Kernels this process queued on the block may still read or write it: unmapping
        // under them faults. The block's streams are not known here, so the device's work
        // is waited for (closes are rare; a failure leaves the range mapped and booked).
        calls.event_sync += 1;
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })?;
        match self.unmap_imported(base + done, len - done, calls) {
            Ok(()) => {
                self.imports.remove(&base);
                self.unreserve(base, len, calls)?;
                Ok(true)
            }
            Err((unmapped, e)) => {
                self.imports.insert(base, (len, ptr, done + unmapped));
                Err(e)
            }
        }
    }

    pub fn imports(&self) -> usize {
        self.imports.len()
    }

    /// Address space the mapped imports hold.
    pub fn import_bytes(&self) -> usize {
        self.imports.values().map(|&(len, _, _)| len).sum()
    }

    /// Unmap the granules of `[from, from + len)` in order, stopping at the first the
    /// driver refuses; on failure, how many bytes were unmapped before it.
    fn unmap_imported(&mut self, from: usize, len: usize, calls: &mut DriverCalls) -> std::result::Result<(), (usize, Error)> {
        for p in (from..from + len).step_by(self.granule) {
            calls.mem_unmap += 1;
            check("cuMemUnmap", unsafe { sys::cuMemUnmap(p as sys::CUdeviceptr, self.granule) }).map_err(|e| (p - from, e))?;
        }
        Ok(())
    }
}

impl Drop for CudaVmm {
    fn drop(&mut self) {
        for (_, fd) in self.exported.drain() {
            crate::upstream::export_record::ExportRecord::granule_released(fd, 0);
            // SAFETY: descriptors `export` got, ours to close; the memory stays mapped.
            unsafe { libc::close(fd) };
        }
    }
}
