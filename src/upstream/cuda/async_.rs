//! `async`: the driver's stream-ordered allocator, `cuMemAllocAsync` / `cuMemFreeAsync` on
//! the caller's stream. With `GPUPOOL_POOL=none` this is CuPy's `MemoryAsyncPool`; with a
//! caching strategy, gpupool caches on top of the driver's pool.

use super::driver::check;
use super::MemKind;
use crate::error::Result;
use cudarc::driver::sys;

pub struct AsyncMem;

// The stream is an opaque driver handle handed to the driver, never dereferenced here.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
impl MemKind for AsyncMem {
    const ALLOC_CALL: &'static str = "cuMemAllocAsync";
    const NAME: &'static str = "async";
    const STREAM_ORDERED: bool = true;
    fn obtain(&mut self, size: usize, stream: sys::CUstream) -> std::result::Result<usize, sys::CUresult> {
        let mut p: sys::CUdeviceptr = 0;
        match unsafe { sys::cuMemAllocAsync(&mut p, size, stream) } {
            sys::CUresult::CUDA_SUCCESS => Ok(p as usize),
            e => Err(e),
        }
    }
    fn release(&mut self, addr: usize, stream: sys::CUstream) -> Result<()> {
        check("cuMemFreeAsync", unsafe { sys::cuMemFreeAsync(addr as sys::CUdeviceptr, stream) })
    }
}
