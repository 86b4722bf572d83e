//! The driver's virtual memory management API for the `arena` strategy: address ranges
//! reserved once (`cuMemAddressReserve`), physical granules created (`cuMemCreate`) and
//! mapped into them (`cuMemMap` + `cuMemSetAccess`), mapped at a second address (an alias:
//! the same handle mapped again, how the arena stitches scattered granules into one range),
//! and released (`cuMemUnmap` + `cuMemRelease`).
//!
//! A physical allocation is one granule (`map_new`) or a chunk of several (`map_chunk`):
//! the driver maps, unmaps and exports an allocation only whole (`cuMemMap` at an offset
//! into a handle is refused), so aliases, releases and exports here take whole allocations,
//! and an alias or an import of a chunk is one `cuMemMap`.
//!
//! Access is granted to the owning device and to the peers enabled for it (Note [Peer
//! access on demand] in `upstream/peers.rs`); enabling a peer grants it what is mapped
//! then (`enable_peer`). Called with the device's primary context current (`CudaUpstream`
//! does that).
//!
//! Granules are created shareable as POSIX file descriptors where the device supports it,
//! so another process can map them (`crate::share::protocol`): `export` hands out a
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
use crate::share::protocol::{new_fd_cloexec, SharedGranule};
use crate::upstream::{AliasFail, AllocError, DriverCalls, UnmapFail};
use cudarc::driver::sys;
use rustc_hash::FxHashMap;
use std::collections::BTreeMap;

pub mod import;
mod pause;

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
    /// Bytes of each allocation `map_new` makes: the device's granularity, or a multiple
    /// of it (`set_granule`).
    granule: usize,
    /// The device's granularity.
    device_granule: usize,
    /// Who may read and write arena memory: the device, then the peers enabled for it.
    access: Vec<sys::CUmemAccessDesc>,
    /// Devices that can access this device's memory as peers (`cuDeviceCanAccessPeer`).
    possible_peers: Vec<sys::CUdevice>,
    /// Physical allocations mapped: base -> (handle, bytes: a granule or a chunk).
    handles: BTreeMap<usize, (sys::CUmemGenericAllocationHandle, usize)>,
    /// Alias address (every granule of an alias) -> the home granule whose memory it shows.
    aliases: FxHashMap<usize, usize>,
    /// Alias mappings: start -> bytes (one per allocation aliased).
    alias_maps: BTreeMap<usize, usize>,
    /// Allocation base -> the file descriptor it was exported as (closed at its release).
    exported: FxHashMap<usize, i32>,
    /// Ranges mapping another process's allocations (`import`): base -> (length, the
    /// address `import` returned, which alone closes it, mappings not yet unmapped by a
    /// close the driver failed midway (a retry resumes there): their lengths in order).
    imports: BTreeMap<usize, (usize, usize, Vec<usize>)>,
    /// What a pause released (`pause.rs`), until the resume.
    paused: Option<pause::PausedSpace>,
    /// Page-locked host memory for paused contents, kept for the next pause.
    backup: Option<pause::HostBackup>,
    /// The stream pause and resume copy on (null until first used).
    copy_stream: sys::CUstream,
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
        let mut possible_peers = Vec::new();
        for peer in (0..n).filter(|&d| d != device) {
            let mut can = 0;
            if unsafe { sys::cuDeviceCanAccessPeer(&mut can, peer, device) } == sys::CUresult::CUDA_SUCCESS && can != 0 {
                possible_peers.push(peer);
            }
        }
        // Peers enabled before this upstream was made (a pool made later on the device).
        for peer in crate::upstream::peers::enabled(device).into_iter().filter(|p| possible_peers.contains(p)) {
            let mut loc = prop.location;
            loc.id = peer;
            access.push(sys::CUmemAccessDesc { location: loc, flags: rw });
        }
        Ok(Some(CudaVmm {
            prop,
            granule: g,
            device_granule: g,
            access,
            possible_peers,
            handles: BTreeMap::new(),
            aliases: FxHashMap::default(),
            alias_maps: BTreeMap::new(),
            exported: FxHashMap::default(),
            imports: BTreeMap::new(),
            paused: None,
            backup: None,
            copy_stream: std::ptr::null_mut(),
        }))
    }

    pub fn granule(&self) -> usize {
        self.granule
    }

    pub fn device_granule(&self) -> usize {
        self.device_granule
    }

    /// Make each allocation `bytes` (a power-of-two multiple of the device's granularity;
    /// anything else keeps the granule). Only while nothing is reserved or mapped.
    pub fn set_granule(&mut self, bytes: usize) -> usize {
        let g = self.device_granule;
        if bytes.is_power_of_two() && bytes >= g && bytes % g == 0 && self.handles.is_empty() && self.imports.is_empty() {
            self.granule = bytes;
        }
        self.granule
    }

    /// What granules are created as now (`VirtualMemory::vmm_memory_kind`).
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
        calls.peer_grants += who.saturating_sub(1) as u64;
        unsafe { sys::cuMemSetAccess(addr as sys::CUdeviceptr, len, self.access.as_ptr(), who) }
    }

    /// Grant access to `[addr, addr + len)`. A peer the driver refuses (peer access not
    /// possible after all) is dropped for good, saying so once, and the grant retried for the
    /// device alone.
    fn set_access(&mut self, addr: usize, len: usize, calls: &mut DriverCalls) -> sys::CUresult {
        let r = self.grant(addr, len, self.access.len(), calls);
        if r == sys::CUresult::CUDA_SUCCESS || self.access.len() == 1 {
            return r;
        }
        let dropped: Vec<String> = self.access[1..].iter().map(|a| a.location.id.to_string()).collect();
        crate::error::warn(&format!(
            "device {}: the driver refused access for peer device(s) {} ({}); their access to this device's \
             memory is given up, and later mappings grant the device alone",
            self.access[0].location.id,
            dropped.join(", "),
            cuda_error("cuMemSetAccess", r)
        ));
        self.access.truncate(1);
        self.grant(addr, len, 1, calls)
    }

    /// Let `peer` (-1: every possible peer) read and write this device's memory from now on
    /// (Note [Peer access on demand]): every mapping made from now on grants it, and what is
    /// mapped now is granted it at once, one call per mapping, each inside one address
    /// reservation as `cuMemSetAccess` needs: this device's allocations, their aliases (not
    /// while paused: the resume maps and grants them), and other processes' memory mapped
    /// here whole. Returns the grants made. A device that cannot access this one as a peer
    /// is refused, saying so. A grant the driver refuses is returned as the error; the peer
    /// stays enabled for the mappings to come (the grants made stay: they are harmless).
    pub fn enable_peer(&mut self, peer: sys::CUdevice, calls: &mut DriverCalls) -> Result<usize> {
        if peer == -1 {
            // Every device that can be a peer of this one; the first refusal is returned
            // once every peer was tried.
            let (mut n, mut first) = (0, None);
            for p in self.possible_peers.clone() {
                match self.enable_peer(p, calls) {
                    Ok(k) => n += k,
                    Err(e) => {
                        first.get_or_insert(e);
                    }
                }
            }
            return first.map_or(Ok(n), Err);
        }
        let device = self.prop.location.id;
        if peer == device || self.access.iter().any(|a| a.location.id == peer) {
            return Ok(0);
        }
        if !self.possible_peers.contains(&peer) {
            return Err(Error::InvalidArgument(format!(
                "peer access: device {peer} cannot access device {device}'s memory (cuDeviceCanAccessPeer says no)"
            )));
        }
        let mut desc = self.access[0];
        desc.location.id = peer;
        self.access.push(desc);
        let mut ranges: Vec<(usize, usize)> = self.handles.iter().map(|(&b, &(_, l))| (b, l)).collect();
        if self.paused.is_none() {
            ranges.extend(self.alias_maps.iter().map(|(&b, &l)| (b, l)));
        }
        ranges.extend(self.imports.iter().filter(|(_, i)| i.2.iter().sum::<usize>() == i.0).map(|(&b, i)| (b, i.0)));
        for &(addr, len) in &ranges {
            calls.set_access += 1;
            calls.peer_grants += 1;
            let r = unsafe { sys::cuMemSetAccess(addr as sys::CUdeviceptr, len, &desc, 1) };
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(Error::Internal(format!(
                    "peer access: granting device {peer} device {device}'s memory at {addr:#x}+{len:#x}: {}",
                    cuda_error("cuMemSetAccess", r)
                )));
            }
        }
        Ok(ranges.len())
    }

    /// The allocation mapped at `addr` (any address in it): (base, handle, bytes).
    fn allocation(&self, addr: usize) -> Option<(usize, sys::CUmemGenericAllocationHandle, usize)> {
        self.handles.range(..=addr).next_back().filter(|(&b, &(_, l))| addr < b + l).map(|(&b, &(h, l))| (b, h, l))
    }

    /// A new physical allocation of `len` bytes. A kind of memory the driver refuses (not
    /// for lack of memory: no IMEX channel for fabric handles, a container without fd
    /// export, no RDMA with VMM) steps down for good: fd + fabric, then fd, then plain,
    /// then without the RDMA flag. Other failures leave the request as it is.
    fn create(&mut self, len: usize, calls: &mut DriverCalls) -> std::result::Result<sys::CUmemGenericAllocationHandle, sys::CUresult> {
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        calls.mem_create += 1;
        let mut r = unsafe { sys::cuMemCreate(&mut h, len, &self.prop, 0) };
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
            r = unsafe { sys::cuMemCreate(&mut h, len, &self.prop, 0) };
        }
        if r == R::CUDA_SUCCESS {
            Ok(h)
        } else {
            Err(r)
        }
    }

    /// New memory under `[addr, addr + len)`: one allocation of `piece` bytes per piece
    /// (a granule each for `map_new`, the whole range for `map_chunk`), one access grant.
    /// All or nothing.
    fn map_pieces(&mut self, addr: usize, len: usize, piece: usize, calls: &mut DriverCalls) -> std::result::Result<(), AllocError> {
        let mut done = 0;
        let mut failure = None;
        while done < len {
            let p = addr + done;
            // Allocations left mapped by the undo of an earlier failed map (below), which
            // the pool booked as unmapped. One laid out as this piece serves as new memory
            // here; any other is unmapped and released first (nothing uses it).
            let left: Vec<(usize, usize)> =
                self.handles.range(..p + piece).rev().take_while(|(&b, &(_, l))| b + l > p).map(|(&b, &(_, l))| (b, l)).collect();
            if left == [(p, piece)] {
                done += piece;
                continue;
            }
            if left.iter().any(|&(b, l)| self.unmap(b, l, calls).is_err()) {
                failure = Some(("cuMemUnmap (an allocation a failed map left behind)", sys::CUresult::CUDA_ERROR_ALREADY_MAPPED));
                break;
            }
            let h = match self.create(piece, calls) {
                Ok(h) => h,
                Err(r) => {
                    failure = Some(("cuMemCreate", r));
                    break;
                }
            };
            calls.mem_map += 1;
            let r = unsafe { sys::cuMemMap(p as sys::CUdeviceptr, piece, 0, h, 0) };
            if r != sys::CUresult::CUDA_SUCCESS {
                calls.mem_release += 1;
                unsafe { sys::cuMemRelease(h) };
                failure = Some(("cuMemMap", r));
                break;
            }
            self.handles.insert(p, (h, piece));
            done += piece;
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
                // All or nothing: undo every allocation mapped here. One the driver will not
                // unmap stays in `handles`, for the next map of its address to take as is.
                for p in (addr..addr + done).step_by(piece) {
                    let _ = self.unmap(p, piece, calls);
                }
                if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                    Err(AllocError::OutOfMemory)
                } else {
                    Err(AllocError::Other(cuda_error(call, r)))
                }
            }
        }
    }

    /// New memory under every granule of `[addr, addr + len)`, one allocation each.
    pub fn map_new(&mut self, addr: usize, len: usize, calls: &mut DriverCalls) -> std::result::Result<(), AllocError> {
        self.map_pieces(addr, len, self.granule, calls)
    }

    /// New memory under `[addr, addr + len)` as one allocation (a chunk).
    pub fn map_chunk(&mut self, addr: usize, len: usize, calls: &mut DriverCalls) -> std::result::Result<(), AllocError> {
        self.map_pieces(addr, len, len, calls)
    }

    /// Unmap and release the allocations of `[addr, addr + len)` (whole ones: the driver
    /// unmaps whole mappings only), in order, stopping at the first failure. An allocation
    /// the driver will not unmap stays mapped (and in `handles`): those before it are gone.
    /// One whose unmap succeeded but whose release failed is gone too (its address is
    /// free, and the next map there must not find it in `handles`): the failure says so,
    /// and its physical memory is leaked.
    pub fn unmap(&mut self, addr: usize, len: usize, calls: &mut DriverCalls) -> std::result::Result<(), UnmapFail> {
        let mut p = addr;
        while p < addr + len {
            let before = p - addr;
            let (h, l) = match self.handles.get(&p) {
                Some(&(h, l)) if p + l <= addr + len => (h, l),
                _ => {
                    let error = Error::Internal(format!("arena: unmap of {p:#x}, which is no whole allocation of {addr:#x}+{len:#x}"));
                    return Err(UnmapFail { unmapped: before, leaked: 0, error });
                }
            };
            calls.mem_unmap += 1;
            check("cuMemUnmap", unsafe { sys::cuMemUnmap(p as sys::CUdeviceptr, l) })
                .map_err(|error| UnmapFail { unmapped: before, leaked: 0, error })?;
            self.handles.remove(&p);
            if let Some(fd) = self.exported.remove(&p) {
                // Exports of it end before its descriptor number can be reused (every
                // export lists its allocations whole, so from offset 0).
                crate::share::protocol::ExportRecord::granule_released(fd, 0);
                // SAFETY: the descriptor `export` got for this allocation, ours to close.
                unsafe { libc::close(fd) };
            }
            calls.mem_release += 1;
            check("cuMemRelease", unsafe { sys::cuMemRelease(h) })
                .map_err(|error| UnmapFail { unmapped: before + l, leaked: l, error })?;
            p += l;
        }
        Ok(())
    }

    /// Map the allocations behind the granules at `homes` side by side from `to` on as
    /// well, then grant access to the whole run in one call (the driver grants access over
    /// a range of separate mappings). `homes` lists whole allocations, each from its first
    /// granule in order: one `cuMemMap` each. On failure the first `made` granules are
    /// aliased (whole allocations) and the caller removes them: a failed grant leaves all
    /// of them mapped.
    pub fn alias(&mut self, homes: &[usize], to: usize, calls: &mut DriverCalls) -> std::result::Result<(), AliasFail> {
        let g = self.granule;
        let mut i = 0;
        while i < homes.len() {
            let home = homes[i];
            let whole = self.allocation(home).filter(|&(b, _, l)| {
                b == home && i + l / g <= homes.len() && (0..l / g).all(|k| homes[i + k] == home + k * g)
            });
            let Some((_, h, l)) = whole else {
                let error = Error::Internal(format!("arena: alias of {home:#x}, which is not the start of a whole mapped allocation"));
                return Err(AliasFail { made: i, error });
            };
            calls.mem_map += 1;
            let at = to + i * g;
            check("cuMemMap", unsafe { sys::cuMemMap(at as sys::CUdeviceptr, l, 0, h, 0) })
                .map_err(|error| AliasFail { made: i, error })?;
            for k in 0..l / g {
                self.aliases.insert(at + k * g, home + k * g);
            }
            self.alias_maps.insert(at, l);
            i += l / g;
        }
        let r = self.set_access(to, homes.len() * g, calls);
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(AliasFail { made: homes.len(), error: cuda_error("cuMemSetAccess", r) });
        }
        Ok(())
    }

    /// Unmap the alias mappings of `[addr, addr + len)` (whole ones); the memory stays
    /// mapped at its home. One call per mapping: the driver unmaps whole mappings only.
    pub fn unalias(&mut self, addr: usize, len: usize, calls: &mut DriverCalls) -> Result<()> {
        let maps: Vec<(usize, usize)> = self.alias_maps.range(addr..addr + len).map(|(&a, &l)| (a, l)).collect();
        let covered: usize = maps.iter().map(|m| m.1).sum();
        if maps.first().map_or(true, |m| m.0 != addr) || covered != len {
            return Err(Error::Internal(format!("arena: unalias of {addr:#x}+{len:#x}, which is not whole alias mappings")));
        }
        let mut first_err = None;
        for (p, l) in maps {
            calls.mem_unmap += 1;
            match check("cuMemUnmap", unsafe { sys::cuMemUnmap(p as sys::CUdeviceptr, l) }) {
                Ok(()) => {
                    self.alias_maps.remove(&p);
                    for k in (p..p + l).step_by(self.granule) {
                        self.aliases.remove(&k);
                    }
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// The shareable descriptor of the allocation behind the granule mapped at `addr` (a
    /// home or an alias) and the granule's offset in it, exported once and kept open until
    /// that allocation is released.
    pub fn export(&mut self, addr: usize, calls: &mut DriverCalls) -> Result<SharedGranule> {
        let home = self.aliases.get(&addr).copied().unwrap_or(addr);
        let Some((base, h, _)) = self.allocation(home) else {
            return Err(Error::Internal(format!("arena: export of {addr:#x}, which is not mapped")));
        };
        let offset = (home - base) as u64;
        if let Some(&fd) = self.exported.get(&base) {
            return Ok(SharedGranule { fd, offset, ..Default::default() });
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
        self.exported.insert(base, fd);
        Ok(SharedGranule { fd, offset, ..Default::default() })
    }

}

impl Drop for CudaVmm {
    fn drop(&mut self) {
        self.drop_pause_resources();
        for (_, fd) in self.exported.drain() {
            crate::share::protocol::ExportRecord::granule_released(fd, 0);
            // SAFETY: descriptors `export` got, ours to close; the memory stays mapped.
            unsafe { libc::close(fd) };
        }
    }
}
