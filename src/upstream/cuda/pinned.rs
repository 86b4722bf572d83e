//! `pinned`: page-locked host memory, `cuMemHostAlloc(CU_MEMHOSTALLOC_PORTABLE)` /
//! `cuMemFreeHost`, for the separate pinned pool (CuPy's `PinnedMemoryPool`). Its capacity
//! is the machine's physical memory.

use super::driver::check;
use super::MemKind;
use crate::error::Result;
use cudarc::driver::sys;

pub struct PinnedMem;

impl MemKind for PinnedMem {
    const ALLOC_CALL: &'static str = "cuMemHostAlloc";
    const NAME: &'static str = "pinned";
    fn obtain(&mut self, size: usize, _stream: sys::CUstream) -> std::result::Result<usize, sys::CUresult> {
        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
        match unsafe { sys::cuMemHostAlloc(&mut p, size, sys::CU_MEMHOSTALLOC_PORTABLE) } {
            sys::CUresult::CUDA_SUCCESS => Ok(p as usize),
            e => Err(e),
        }
    }
    fn release(&mut self, addr: usize, _stream: sys::CUstream) -> Result<()> {
        check("cuMemFreeHost", unsafe { sys::cuMemFreeHost(addr as *mut std::ffi::c_void) })
    }
    fn mem_info(&mut self) -> Result<(usize, usize)> {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(0) as usize;
        let total = unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) }.max(0) as usize * page;
        let avail = unsafe { libc::sysconf(libc::_SC_AVPHYS_PAGES) }.max(0) as usize * page;
        Ok((avail, total))
    }
}
