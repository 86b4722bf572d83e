//! `vmm`: device memory mapped page by page with the driver's virtual memory management
//! (`cuMemAddressReserve`, `cuMemCreate`, `cuMemMap`, `cuMemSetAccess`).
//!
//! A segment is an address range whose pages (the device's allocation granularity, 2 MiB
//! on current GPUs) each have their own physical allocation. That costs more driver calls
//! than one `cuMemAlloc`, and buys what `cuMemAlloc` cannot do: give back the memory of
//! pages inside a segment that still has live blocks (`decommit`) and back them again
//! later (`commit`), so the pool's free space between live blocks is not stranded.
//! Memory is ordinary device memory to every kernel, copy and framework.
//!
//! A page's handle is kept until its unmap succeeds: a decommit the driver fails part-way
//! says exactly which pages went back (`UnmapFail`), so the pool's books match what is
//! mapped, and a segment release that fails keeps the segment, whose pages still mapped a
//! later release unmaps.

use super::driver::check;
use super::MemKind;
use crate::error::{Error, Result};
use crate::upstream::UnmapFail;
use cudarc::driver::sys;
use rustc_hash::FxHashMap;

pub struct VmmMem {
    device: sys::CUdevice,
    page: usize,
    /// Address range size of each segment, by base.
    ranges: FxHashMap<usize, usize>,
    /// Physical allocation behind each mapped page, by page address.
    pages: FxHashMap<usize, sys::CUmemGenericAllocationHandle>,
}

impl VmmMem {
    pub fn new() -> Self {
        VmmMem { device: 0, page: 0, ranges: FxHashMap::default(), pages: FxHashMap::default() }
    }

    fn prop(&self) -> sys::CUmemAllocationProp {
        super::address_space::device_prop(self.device)
    }

    /// Map fresh physical pages over the unmapped pages of `[addr, addr + len)` and make
    /// the range readable and writable by the device. A page still mapped keeps its memory
    /// (one whose unmap failed when a commit was undone). All or nothing: on failure the
    /// pages mapped here are unmapped again, and one the driver refuses to unmap stays
    /// mapped with its handle kept, as any mapped page.
    fn map_pages(&mut self, addr: usize, len: usize) -> std::result::Result<(), sys::CUresult> {
        let prop = self.prop();
        let mut mapped = Vec::new();
        let mut failure = None;
        for p in (addr..addr + len).step_by(self.page) {
            if self.pages.contains_key(&p) {
                continue;
            }
            let mut h: sys::CUmemGenericAllocationHandle = 0;
            let r = unsafe { sys::cuMemCreate(&mut h, self.page, &prop, 0) };
            if r != sys::CUresult::CUDA_SUCCESS {
                failure = Some(r);
                break;
            }
            let r = unsafe { sys::cuMemMap(p as sys::CUdeviceptr, self.page, 0, h, 0) };
            if r != sys::CUresult::CUDA_SUCCESS {
                unsafe { sys::cuMemRelease(h) };
                failure = Some(r);
                break;
            }
            self.pages.insert(p, h);
            mapped.push(p);
        }
        if failure.is_none() {
            let desc = sys::CUmemAccessDesc {
                location: prop.location,
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            let r = unsafe { sys::cuMemSetAccess(addr as sys::CUdeviceptr, len, &desc, 1) };
            if r != sys::CUresult::CUDA_SUCCESS {
                failure = Some(r);
            }
        }
        match failure {
            None => Ok(()),
            Some(r) => {
                for p in mapped {
                    let _ = self.unmap_pages(p, self.page);
                }
                Err(r)
            }
        }
    }

    /// Unmap and release the mapped pages of `[addr, addr + len)` in order (unmapped ones
    /// are skipped), stopping at the first failure, which says how much is unmapped
    /// (`UnmapFail`): the pages before the failing one, and that one too where only the
    /// release of its memory failed (its handle is gone, its memory leaked). The page whose
    /// unmap failed and those after it stay mapped, their handles kept, so the caller's
    /// books still hold them and a later call unmaps them.
    fn unmap_pages(&mut self, addr: usize, len: usize) -> std::result::Result<(), UnmapFail> {
        for p in (addr..addr + len).step_by(self.page) {
            let Some(&h) = self.pages.get(&p) else { continue };
            let before = p - addr;
            check("cuMemUnmap", unsafe { sys::cuMemUnmap(p as sys::CUdeviceptr, self.page) })
                .map_err(|error| UnmapFail { unmapped: before, leaked: 0, error })?;
            self.pages.remove(&p);
            check("cuMemRelease", unsafe { sys::cuMemRelease(h) })
                .map_err(|error| UnmapFail { unmapped: before + self.page, leaked: self.page, error })?;
        }
        Ok(())
    }
}

impl Default for VmmMem {
    fn default() -> Self {
        Self::new()
    }
}

impl MemKind for VmmMem {
    const ALLOC_CALL: &'static str = "cuMemCreate";
    const NAME: &'static str = "vmm";

    fn init(&mut self, device: sys::CUdevice) -> Result<()> {
        self.device = device;
        let mut vmm = 0;
        check("cuDeviceGetAttribute", unsafe {
            sys::cuDeviceGetAttribute(
                &mut vmm,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
                device,
            )
        })?;
        if vmm == 0 {
            return Err(Error::InvalidArgument(
                "GPUPOOL_UPSTREAM=vmm: this device does not support virtual memory management; use device".into(),
            ));
        }
        self.page = super::address_space::granularity(
            &self.prop(),
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )?;
        Ok(())
    }

    fn obtain(&mut self, size: usize, _stream: sys::CUstream) -> std::result::Result<usize, sys::CUresult> {
        let len = size.div_ceil(self.page) * self.page;
        let mut base: sys::CUdeviceptr = 0;
        let r = unsafe { sys::cuMemAddressReserve(&mut base, len, self.page, 0, 0) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(r);
        }
        if let Err(r) = self.map_pages(base as usize, len) {
            // A page whose unmap failed keeps the range reserved (given up, never reused),
            // so no later range can meet its handle.
            if !(base as usize..base as usize + len).step_by(self.page).any(|p| self.pages.contains_key(&p)) {
                unsafe { sys::cuMemAddressFree(base, len) };
            }
            return Err(r);
        }
        self.ranges.insert(base as usize, len);
        Ok(base as usize)
    }

    fn release(&mut self, addr: usize, _stream: sys::CUstream) -> Result<()> {
        let len = *self
            .ranges
            .get(&addr)
            .ok_or_else(|| Error::Internal(format!("vmm: {addr:#x} is not a segment of this upstream")))?;
        // A failure keeps the segment (the pool keeps it too, and releases it again later):
        // the pages still mapped keep their handles, and the retry unmaps only those.
        self.unmap_pages(addr, len).map_err(|f| f.error)?;
        check("cuMemAddressFree", unsafe { sys::cuMemAddressFree(addr as sys::CUdeviceptr, len) })?;
        self.ranges.remove(&addr);
        Ok(())
    }

    fn page_size(&self) -> usize {
        self.page
    }

    fn commit(&mut self, addr: usize, len: usize) -> std::result::Result<(), sys::CUresult> {
        self.map_pages(addr, len)
    }

    fn decommit(&mut self, addr: usize, len: usize) -> std::result::Result<(), UnmapFail> {
        self.unmap_pages(addr, len)
    }
}
