//! `managed`: unified memory, `cuMemAllocManaged(CU_MEM_ATTACH_GLOBAL)` / `cuMemFree`,
//! pooled the way CuPy's docs pool `malloc_managed`. The memory limit and reports use the
//! device's `cuMemGetInfo`, like the other device kinds.

use super::driver::check;
use super::MemKind;
use crate::error::Result;
use cudarc::driver::sys;

pub struct ManagedMem;

impl MemKind for ManagedMem {
    const ALLOC_CALL: &'static str = "cuMemAllocManaged";
    const NAME: &'static str = "managed";
    fn obtain(&mut self, size: usize, _stream: sys::CUstream) -> std::result::Result<usize, sys::CUresult> {
        let mut p: sys::CUdeviceptr = 0;
        let flags = sys::CUmemAttach_flags_enum::CU_MEM_ATTACH_GLOBAL as u32;
        match unsafe { sys::cuMemAllocManaged(&mut p, size, flags) } {
            sys::CUresult::CUDA_SUCCESS => Ok(p as usize),
            e => Err(e),
        }
    }
    fn release(&mut self, addr: usize, _stream: sys::CUstream) -> Result<()> {
        check("cuMemFree", unsafe { sys::cuMemFree_v2(addr as sys::CUdeviceptr) })
    }
}
