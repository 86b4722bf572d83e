//! `device`: plain device memory, `cuMemAlloc` / `cuMemFree`.

use super::driver::check;
use super::MemKind;
use crate::error::Result;
use cudarc::driver::sys;

pub struct DeviceMem;

impl MemKind for DeviceMem {
    const ALLOC_CALL: &'static str = "cuMemAlloc";
    const NAME: &'static str = "device";
    fn obtain(&mut self, size: usize, _stream: sys::CUstream) -> std::result::Result<usize, sys::CUresult> {
        let mut p: sys::CUdeviceptr = 0;
        match unsafe { sys::cuMemAlloc_v2(&mut p, size) } {
            sys::CUresult::CUDA_SUCCESS => Ok(p as usize),
            e => Err(e),
        }
    }
    fn release(&mut self, addr: usize, _stream: sys::CUstream) -> Result<()> {
        check("cuMemFree", unsafe { sys::cuMemFree_v2(addr as sys::CUdeviceptr) })
    }
}
