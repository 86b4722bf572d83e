//! CuPy entry points for `cupy.cuda.memory.CFunctionAllocator(param, malloc, free, owner)`.
//!
//! Stream policy (CuPy passes no stream): CuPy blocks are tagged with the legacy default
//! stream, and a CuPy-freed block is reused only after a fence (an event record) has been
//! enqueued on the legacy stream after its free (fences are batched, see
//! `Pool::free_unordered`, and per thread `thread_cache`'s magazine).
//! Work that CuPy later issues on any *blocking* stream — CuPy's default stream, the
//! per-thread default stream, and `cupy.cuda.Stream()` (non_blocking=False, CuPy's default)
//! — waits for earlier legacy-stream work, and the fence waited for all earlier work on
//! blocking streams; so a block is never reused while a kernel launched before its free may
//! still touch it. Streams created with `non_blocking=True` opt out of that ordering: with
//! them, synchronise before dropping arrays (README).
//!
//! Out of memory: CuPy 14 declares its malloc pointer type without `except +` and stores
//! whatever comes back, so a C++ exception would abort Python and a NULL would become an
//! array at address 0. CuPy calls the allocator with the GIL held, so the failure is raised
//! as a Python `MemoryError` (other failures `RuntimeError`) through the C-API of the running
//! interpreter, and NULL is returned; CPython then surfaces it as
//! `SystemError(... returned a result with an exception set)` caused by our `MemoryError`,
//! whose text is gpupool's message.

use super::boundary::call;
use super::core::free_with;
use super::report::call_void;
use crate::error::Error;
use crate::thread_cache;
use std::ffi::{c_char, c_int, c_void, CString};

type PyErrSetString = unsafe extern "C" fn(*mut c_void, *const c_char);
type PyGilStateCheck = unsafe extern "C" fn() -> c_int;

/// Raise a Python exception in the running interpreter, if there is one and we hold the GIL.
fn raise_python(oom: bool, msg: &str) -> bool {
    // SAFETY: dlsym lookups; the symbols have the CPython ABI types declared above.
    unsafe {
        let set = libc::dlsym(libc::RTLD_DEFAULT, c"PyErr_SetString".as_ptr());
        let gil = libc::dlsym(libc::RTLD_DEFAULT, c"PyGILState_Check".as_ptr());
        let exc_name = if oom { c"PyExc_MemoryError" } else { c"PyExc_RuntimeError" };
        let exc = libc::dlsym(libc::RTLD_DEFAULT, exc_name.as_ptr()) as *const *mut c_void;
        if set.is_null() || gil.is_null() || exc.is_null() {
            return false;
        }
        let gil: PyGilStateCheck = std::mem::transmute(gil);
        if gil() == 0 {
            return false;
        }
        let set: PyErrSetString = std::mem::transmute(set);
        let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
        set(*exc, c.as_ptr());
        true
    }
}

/// `void *malloc(void *param, size_t size, int device)`.
///
/// # Safety
/// Called by CuPy with the GIL held; no other requirement.
#[no_mangle]
pub unsafe extern "C" fn gpupool_cupy_malloc(param: *mut c_void, size: usize, device: c_int) -> *mut c_void {
    let _ = param; // CuPy passes the `param` given to CFunctionAllocator; gpupool needs none
    let mut out = std::ptr::null_mut();
    let mut err: Option<Error> = None;
    call(|| {
        thread_cache::malloc_unordered(device, size)
            .map(|a| out = a as *mut c_void)
            .inspect_err(|e| err = Some(e.clone()))
    });
    if let Some(e) = err {
        let oom = matches!(e, Error::OutOfMemory(_));
        if !raise_python(oom, &e.to_string()) {
            eprintln!("{e} (from gpupool_cupy_malloc; no Python interpreter to raise in)");
        }
    }
    out
}

/// `void free(void *param, void *ptr, int device)`: free, then fence the legacy stream.
///
/// # Safety
/// No requirement beyond the C prototype.
#[no_mangle]
pub unsafe extern "C" fn gpupool_cupy_free(param: *mut c_void, ptr: *mut c_void, device: c_int) {
    let _ = param;
    let p = ptr as usize;
    call_void("gpupool_cupy_free", || {
        if p != 0 && thread_cache::try_free_unordered(device, p) {
            return Ok(());
        }
        free_with(p, device, |pool| pool.free_unordered(p))
    });
}
