//! PyTorch entry points for `torch.cuda.memory.CUDAPluggableAllocator` (exact signatures;
//! PyTorch casts to them). The allocation function is C++ (`torch_shim.cpp`): it must throw
//! on failure. Hooks are installed by `python/gpupool/torch.py` through
//! `allocator._allocator.set_*_fn(address)`.

use super::boundary::{call, call_value};
use super::report::call_void;
use crate::error::{Error, Result, Status};
use crate::front::device;
use crate::front::private_pools::{self, Callback};
use std::ffi::{c_int, c_void};

extern "C-unwind" {
    /// torch_shim.cpp: allocates through `gpupool_malloc`, throws a C++ exception on failure.
    fn gpupool_torch_malloc_or_throw(size: usize, device: c_int, stream: *mut c_void) -> *mut c_void;
}

/// `void *alloc(size_t size, int device, cudaStream_t stream)`. Never returns NULL for
/// `size > 0`: a failure is thrown as a C++ exception (`std::bad_alloc` subclass for out of
/// memory, `std::runtime_error` otherwise) that PyTorch turns into a Python `RuntimeError`
/// with gpupool's message. For PyTorch only: C callers use `gpupool_malloc`.
///
/// # Safety
/// Must be called from C++ code prepared for exceptions (PyTorch is).
#[no_mangle]
pub unsafe extern "C-unwind" fn gpupool_torch_malloc(size: usize, device: c_int, stream: *mut c_void) -> *mut c_void {
    gpupool_torch_malloc_or_throw(size, device, stream)
}

/// `void free(void *ptr, size_t size, int device, cudaStream_t stream)`. The size PyTorch
/// passes is not trusted: the pool looks it up.
///
/// # Safety
/// No requirement beyond the C prototype.
#[no_mangle]
pub unsafe extern "C" fn gpupool_torch_free(ptr: *mut c_void, size: usize, device: c_int, stream: *mut c_void) {
    let _ = size; // the pool knows each block's size
    call_void("gpupool_torch_free", || crate::front::free(ptr as usize, device, stream as usize));
}

/// `init(int device_count)`: loads the driver early so the first allocation does not pay it.
#[no_mangle]
pub extern "C" fn gpupool_torch_init(device_count: c_int) {
    let _ = device_count;
    call_void("gpupool_torch_init", device::load_driver);
}

/// `reset()`: `torch.cuda.empty_cache()` → release cached memory of every device.
#[no_mangle]
pub extern "C" fn gpupool_torch_reset() {
    call_void("gpupool_torch_reset", || {
        device::empty_cache()
    });
}

/// `memory_fraction(double fraction, int device)`: `set_per_process_memory_fraction` →
/// the device's pool limit becomes `fraction` × device total memory.
#[no_mangle]
pub extern "C" fn gpupool_torch_memory_fraction(fraction: f64, device: c_int) {
    call_void("gpupool_torch_memory_fraction", || {
        device::set_limit_fraction(device, fraction)
    });
}

/// `record_stream(void *ptr, cudaStream_t stream)`: `Tensor.record_stream`.
///
/// # Safety
/// No requirement beyond the C prototype.
#[no_mangle]
pub unsafe extern "C" fn gpupool_torch_record_stream(ptr: *mut c_void, stream: *mut c_void) {
    call_void("gpupool_torch_record_stream", || device::record_stream(ptr as usize, stream as usize));
}

/// The size of the block that holds the live allocation `ptr` (what the pool counts in use
/// for it: the request rounded, or more where the rest was too small to split off); 0 for a
/// pointer that is not a live allocation.
#[no_mangle]
pub extern "C" fn gpupool_torch_block_size(ptr: *mut c_void) -> usize {
    let p = ptr as usize;
    call_value(0, || device::block_size(p).unwrap_or(0))
}

/// `void *base_alloc(void *ptr, size_t *size)`: the upstream allocation holding `ptr` (for
/// IPC handles and CUDA graphs); `*size` receives its length. NULL for unknown pointers.
///
/// # Safety
/// `size` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gpupool_torch_base_alloc(ptr: *mut c_void, size: *mut usize) -> *mut c_void {
    let mut out = std::ptr::null_mut();
    call_void("gpupool_torch_base_alloc", || {
        let p = ptr as usize;
        let (base, len) = device::segment_of(p)?;
        if !size.is_null() {
            *size = len;
        }
        out = base as *mut c_void;
        Ok(())
    });
    out
}

extern "C" {
    /// torch_shim.cpp: a heap copy of PyTorch's `std::function<bool(cudaStream_t)>` (NULL if
    /// copying failed), its call, and its deletion.
    fn gpupool_torch_filter_adopt(filter: *const c_void) -> *mut c_void;
    fn gpupool_torch_filter_call(ctx: *mut c_void, stream: *mut c_void) -> c_int;
    fn gpupool_torch_filter_drop(ctx: *mut c_void);
}

/// `beginAllocateToPool(int device, MempoolId_t id, std::function<bool(cudaStream_t)> filter)`:
/// until `end_allocate_to_pool`, allocations on `device` whose stream `filter` accepts (the
/// capturing stream of a `torch.cuda.graph`, the thread inside `use_mem_pool`) come from
/// the private pool `id`. The C prototype is ABI-identical to PyTorch's C++ one on x86-64
/// and AArch64: the trivially copyable `std::pair<uint64_t, uint64_t>` travels as two
/// integers, the `std::function` as a pointer to the caller's temporary.
///
/// # Safety
/// `filter` must point to a live `std::function<bool(cudaStream_t)>` (PyTorch's), or be NULL.
#[no_mangle]
pub unsafe extern "C" fn gpupool_torch_begin_allocate_to_pool(device: c_int, id_first: u64, id_second: u64, filter: *const c_void) {
    call_void("gpupool_torch_begin_allocate_to_pool", || begin_route(device, (id_first, id_second), filter));
}

/// `endAllocateToPool(int device, MempoolId_t id)`: the capture (or `use_mem_pool`) ended.
#[no_mangle]
pub extern "C" fn gpupool_torch_end_allocate_to_pool(device: c_int, id_first: u64, id_second: u64) {
    call_void("gpupool_torch_end_allocate_to_pool", || end_route(device, (id_first, id_second)));
}

/// `releasePool(int device, MempoolId_t id)`: a graph using the pool was destroyed (or a
/// `use_mem_pool` scope closed). The pool's memory goes back when no use is left and none
/// of its blocks is live.
#[no_mangle]
pub extern "C" fn gpupool_torch_release_pool(device: c_int, id_first: u64, id_second: u64) {
    call_void("gpupool_torch_release_pool", || release(device, (id_first, id_second)));
}

// The same three with a status, for gpupool's compiled PyTorch allocator (which raises
// the error in Python where the hooks above can only print it), and the private-pool
// calls only that allocator makes.

/// `gpupool_torch_begin_allocate_to_pool` with a status.
///
/// # Safety
/// As `gpupool_torch_begin_allocate_to_pool`.
#[no_mangle]
pub unsafe extern "C" fn gpupool_torch_pool_begin(device: c_int, id_first: u64, id_second: u64, filter: *const c_void) -> Status {
    call(|| begin_route(device, (id_first, id_second), filter))
}

/// `gpupool_torch_end_allocate_to_pool` with a status.
#[no_mangle]
pub extern "C" fn gpupool_torch_pool_end(device: c_int, id_first: u64, id_second: u64) -> Status {
    call(|| end_route(device, (id_first, id_second)))
}

/// `gpupool_torch_release_pool` with a status.
#[no_mangle]
pub extern "C" fn gpupool_torch_pool_release(device: c_int, id_first: u64, id_second: u64) -> Status {
    call(|| release(device, (id_first, id_second)))
}

/// `createOrIncrefPool(int device, MempoolId_t id)`: one more use of the private pool `id`
/// (made if new), as `torch.cuda.MemPool`'s constructor asks; a release drops it.
#[no_mangle]
pub extern "C" fn gpupool_torch_pool_create(device: c_int, id_first: u64, id_second: u64) -> Status {
    call(|| private_pools::create(device, (id_first, id_second)))
}

/// `getPoolUseCount(int device, MempoolId_t id)`: `*out_uses` receives the uses of the
/// private pool `id` (0 when it does not exist).
///
/// # Safety
/// `out_uses` must be NULL (rejected) or writable.
#[no_mangle]
pub unsafe extern "C" fn gpupool_torch_pool_use_count(device: c_int, id_first: u64, id_second: u64, out_uses: *mut i64) -> Status {
    call(|| {
        if out_uses.is_null() {
            return Err(Error::NullArgument("out_uses"));
        }
        *out_uses = private_pools::uses(device, (id_first, id_second))?;
        Ok(())
    })
}

/// `emptyCache(MempoolId_t id)` for a private pool: its memory goes back if nothing uses it
/// and none of its blocks is live. `*out_released` (optional) receives the bytes released.
///
/// # Safety
/// `out_released` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gpupool_torch_pool_empty(device: c_int, id_first: u64, id_second: u64, out_released: *mut usize) -> Status {
    call(|| {
        let n = private_pools::empty(device, (id_first, id_second))?;
        if !out_released.is_null() {
            *out_released = n;
        }
        Ok(())
    })
}

unsafe fn begin_route(device: c_int, id: (u64, u64), filter: *const c_void) -> Result<()> {
    if filter.is_null() {
        return Err(Error::NullArgument("filter"));
    }
    let ctx = gpupool_torch_filter_adopt(filter);
    if ctx.is_null() {
        return Err(Error::Internal("could not copy PyTorch's allocation filter".into()));
    }
    let cb = Callback { call: gpupool_torch_filter_call, ctx, drop: Some(gpupool_torch_filter_drop) };
    private_pools::begin_filtered(device, id, cb)
}

fn end_route(device: c_int, id: (u64, u64)) -> Result<()> {
    private_pools::end(device, id)
}

fn release(device: c_int, id: (u64, u64)) -> Result<()> {
    private_pools::release(device, id)
}
