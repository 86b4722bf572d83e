//! `vmm`: device memory mapped page by page with the driver's virtual memory management
//! (`cuMemAddressReserve`, `cuMemCreate`, `cuMemMap`, `cuMemSetAccess`).
//!
//! A segment is an address range whose pages (the device's allocation granularity, 2 MiB
//! on current GPUs) each have their own physical allocation. That costs more driver calls
//! than one `cuMemAlloc`, and buys what `cuMemAlloc` cannot do: give back the memory of
//! pages inside a segment that still has live blocks (`decommit`) and back them again
//! later (`commit`), so the pool's free space between live blocks is not stranded.
//! Memory is ordinary device memory to every kernel, copy and framework.

use super::driver::check;
use super::MemKind;
use crate::error::{Error, Result};
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

    /// Map fresh physical pages over `[addr, addr + len)` and make them readable and
    /// writable by the device. On failure everything mapped here is undone.
    fn map_pages(&mut self, addr: usize, len: usize) -> std::result::Result<(), sys::CUresult> {
        let prop = self.prop();
        let mut done = 0;
        let mut failure = None;
        while done < len {
            let p = addr + done;
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
            done += self.page;
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
                let _ = self.unmap_pages(addr, done);
                Err(r)
            }
        }
    }

    /// Unmap and release the mapped pages of `[addr, addr + len)` (unmapped ones are skipped).
    fn unmap_pages(&mut self, addr: usize, len: usize) -> Result<()> {
        let mut first_err = None;
        for p in (addr..addr + len).step_by(self.page) {
            if let Some(h) = self.pages.remove(&p) {
                if let Err(e) = check("cuMemUnmap", unsafe { sys::cuMemUnmap(p as sys::CUdeviceptr, self.page) }) {
                    first_err.get_or_insert(e);
                }
                if let Err(e) = check("cuMemRelease", unsafe { sys::cuMemRelease(h) }) {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
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
            unsafe { sys::cuMemAddressFree(base, len) };
            return Err(r);
        }
        self.ranges.insert(base as usize, len);
        Ok(base as usize)
    }

    fn release(&mut self, addr: usize, _stream: sys::CUstream) -> Result<()> {
        let len = self
            .ranges
            .remove(&addr)
            .ok_or_else(|| Error::Internal(format!("vmm: {addr:#x} is not a segment of this upstream")))?;
        let unmapped = self.unmap_pages(addr, len);
        check("cuMemAddressFree", unsafe { sys::cuMemAddressFree(addr as sys::CUdeviceptr, len) })?;
        unmapped
    }

    fn page_size(&self) -> usize {
        self.page
    }

    fn commit(&mut self, addr: usize, len: usize) -> std::result::Result<(), sys::CUresult> {
        self.map_pages(addr, len)
    }

    fn decommit(&mut self, addr: usize, len: usize) -> Result<()> {
        self.unmap_pages(addr, len)
    }
}
