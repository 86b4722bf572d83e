//! CuPy entry points for `cupy.cuda.memory.CFunctionAllocator(param, malloc, free, owner)`.
//!
//! Stream policy. CuPy passes no stream to an allocator, but it exposes the calling
//! thread's current stream to C (`cupy.cuda.stream.__pyx_capi__["get_current_stream_ptr"]`,
//! `intptr_t (void)`); `gpupool.cupy.install()` hands that function to
//! `gpupool_cupy_set_stream_getter`. A program that installs the two symbols itself
//! (`CFunctionAllocator(0, gpupool_cupy_malloc, gpupool_cupy_free, lib)`) registers
//! nothing, so the first `gpupool_cupy_malloc` looks the function up itself, through the
//! C-API of the interpreter that calls it (CuPy holds the GIL there): the loaded
//! `cupy.cuda.stream` module's capsule, as `install()` reads it. With it:
//! - an allocation is made for CuPy's current stream, exactly as a PyTorch allocation is for
//!   PyTorch's: reuse on the same stream is protected by stream order, reuse on another stream
//!   waits for an event recorded at the free (legacy stream: recorded lazily);
//! - a free goes to the stream the block was allocated for (CuPy's own pool likewise reuses a
//!   block only on its allocation stream), so non-blocking streams (`Stream(non_blocking=True)`),
//!   `Stream.ptds` and `ExternalStream`s are ordered like any other. The free records that
//!   stream's event only when it is CuPy's current stream (alive now): any other may have
//!   been destroyed since the allocation, so its blocks stay on it (other streams get them
//!   after a device-wide wait, made only where the pool would otherwise grow);
//! - a stream capturing a CUDA graph is asked about at each allocation and free on a
//!   non-default stream (one `cuStreamGetCaptureInfo`): allocations go to a private pool for
//!   that capture and frees record no event there (`pool/graph_pools.rs`).
//!
//! Without a getter (a caller that never registered one) the older rule applies: blocks are
//! tagged with the legacy stream and reused only after a fence on it (`FreeOn::Unordered`),
//! which orders blocking streams only.
//!
//! Out of memory. CuPy calls the allocator with the GIL held, so a failure is raised as a
//! Python exception through the C-API of the running interpreter and NULL is returned: out
//! of memory as the class `gpupool_cupy_set_oom_error` registered (`gpupool.cupy` registers
//! `gpupool.cupy.OutOfMemoryError`, a subclass of `cupy.cuda.memory.OutOfMemoryError`; a
//! plain `MemoryError` while none is), anything else as `RuntimeError`, each with gpupool's
//! message. What the caller then sees depends on whether CuPy checks for a Python error
//! after the call:
//! - Where it does not (the cupy-cuda13x 14.2.0 wheel), the
//!   NULL comes back with an exception set, and CPython reports `SystemError(... returned a
//!   result with an exception set)` caused by ours. `gpupool.cupy.install(typed_oom=True)`
//!   then calls this function from a Python-level allocator, through ctypes with the GIL
//!   held, which raises ours as is.
//! - Where it does (cupy/cupy's source declares the call `except +` inside a helper declared
//!   `except *` from its v14.1.0 tag on), ours reaches the caller as is.
//!
//! A C++ exception is no option: a CuPy without `except +` would abort the process, and one
//! with it turns any C++ exception into a plain `MemoryError` or `RuntimeError`.

use super::boundary::call;
use super::report::call_void;
use crate::error::Error;
use crate::front;
use std::ffi::{c_char, c_int, c_void, CString};
use std::sync::atomic::{AtomicUsize, Ordering};

/// CuPy's `get_current_stream_ptr` (0: none registered).
static STREAM_GETTER: AtomicUsize = AtomicUsize::new(0);

/// Whether the getter is settled: registered (or refused) by `gpupool_cupy_set_stream_getter`,
/// or looked for by `discover_stream_getter` with the GIL held.
static GETTER_SETTLED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

type StreamGetter = unsafe extern "C" fn() -> isize;

fn current_stream() -> Option<usize> {
    match STREAM_GETTER.load(Ordering::Acquire) {
        0 => None,
        // SAFETY: registered by `gpupool_cupy_set_stream_getter` with this type.
        f => Some(unsafe { std::mem::transmute::<usize, StreamGetter>(f)() } as usize),
    }
}

/// Register CuPy's `get_current_stream_ptr` (`intptr_t (void)`), or NULL to forget it.
/// From then on CuPy allocations are made for CuPy's current stream (see the module notes).
///
/// # Safety
/// `getter` must be NULL or a function of that type callable for the life of the process
/// on any thread that allocates through CuPy.
#[no_mangle]
pub unsafe extern "C" fn gpupool_cupy_set_stream_getter(getter: Option<unsafe extern "C" fn() -> isize>) {
    STREAM_GETTER.store(getter.map_or(0, |f| f as usize), Ordering::Release);
    GETTER_SETTLED.store(true, Ordering::Release);
}

/// The signature CuPy's capsule names (spaces aside; Cython may add `noexcept`).
fn getter_signature_ok(name: &std::ffi::CStr) -> bool {
    let sig: String = name.to_string_lossy().chars().filter(|c| !c.is_whitespace()).collect();
    sig == "intptr_t(void)" || sig == "intptr_t(void)noexcept"
}

/// Find CuPy's `get_current_stream_ptr` in the running interpreter, for a caller that
/// installed `gpupool_cupy_malloc` without registering it (the raw `CFunctionAllocator`
/// route). Only with the GIL held (CuPy's calls hold it); only from a `cupy.cuda.stream`
/// already loaded (no import runs from inside an allocation). Without an interpreter, or
/// without the GIL, nothing is settled and a later call looks again; without CuPy's module
/// or its capsule, the stream-less rule stays (module notes).
fn discover_stream_getter() {
    type Obj = *mut c_void;
    // SAFETY: dlsym lookups of CPython's stable C-API, called with the types it declares,
    // with the GIL held (checked first); borrowed references are not kept past the calls,
    // the one new reference (`__pyx_capi__`) is released, and any Python error raised
    // here is cleared so the caller's state is as it was.
    unsafe {
        let sym = |n: &std::ffi::CStr| libc::dlsym(libc::RTLD_DEFAULT, n.as_ptr());
        let (gil, modules, get_item, get_attr, cap_name, cap_ptr, dec_ref, clear) = (
            sym(c"PyGILState_Check"),
            sym(c"PyImport_GetModuleDict"),
            sym(c"PyDict_GetItemString"),
            sym(c"PyObject_GetAttrString"),
            sym(c"PyCapsule_GetName"),
            sym(c"PyCapsule_GetPointer"),
            sym(c"Py_DecRef"),
            sym(c"PyErr_Clear"),
        );
        if [gil, modules, get_item, get_attr, cap_name, cap_ptr, dec_ref, clear].iter().any(|p| p.is_null()) {
            GETTER_SETTLED.store(true, Ordering::Release); // no interpreter in this process
            return;
        }
        let gil: unsafe extern "C" fn() -> c_int = std::mem::transmute(gil);
        if gil() == 0 {
            return; // not now: a later call with the GIL looks again
        }
        let modules: unsafe extern "C" fn() -> Obj = std::mem::transmute(modules);
        let get_item: unsafe extern "C" fn(Obj, *const c_char) -> Obj = std::mem::transmute(get_item);
        let get_attr: unsafe extern "C" fn(Obj, *const c_char) -> Obj = std::mem::transmute(get_attr);
        let cap_name: unsafe extern "C" fn(Obj) -> *const c_char = std::mem::transmute(cap_name);
        let cap_ptr: unsafe extern "C" fn(Obj, *const c_char) -> *mut c_void = std::mem::transmute(cap_ptr);
        let dec_ref: unsafe extern "C" fn(Obj) = std::mem::transmute(dec_ref);
        let clear: unsafe extern "C" fn() = std::mem::transmute(clear);
        GETTER_SETTLED.store(true, Ordering::Release);
        let dict = modules();
        let module = if dict.is_null() { dict } else { get_item(dict, c"cupy.cuda.stream".as_ptr()) };
        if module.is_null() {
            clear();
            return;
        }
        let capi = get_attr(module, c"__pyx_capi__".as_ptr());
        if capi.is_null() {
            clear();
            return;
        }
        let capsule = get_item(capi, c"get_current_stream_ptr".as_ptr());
        let name = if capsule.is_null() { std::ptr::null() } else { cap_name(capsule) };
        let f = if !name.is_null() && getter_signature_ok(std::ffi::CStr::from_ptr(name)) { cap_ptr(capsule, name) } else { std::ptr::null_mut() };
        dec_ref(capi);
        clear();
        if !f.is_null() {
            STREAM_GETTER.store(f as usize, Ordering::Release);
        }
    }
}

/// The Python class raised for out of memory (a `PyObject *`; 0: `MemoryError`).
static OOM_ERROR: AtomicUsize = AtomicUsize::new(0);

/// Python only, hence left out of the C header (its argument is a Python object): make
/// `gpupool_cupy_malloc` raise `exc_type` for out of memory instead of `MemoryError`, or
/// `MemoryError` again with NULL. `gpupool.cupy` registers `gpupool.cupy.OutOfMemoryError`.
///
/// cbindgen:ignore
///
/// # Safety
/// `exc_type` must be NULL or a Python exception class (`PyObject *`) whose constructor takes
/// one argument, the message, and which stays alive for the life of the process (the caller
/// holds a reference that is never released).
#[no_mangle]
pub unsafe extern "C" fn gpupool_cupy_set_oom_error(exc_type: *mut c_void) {
    OOM_ERROR.store(exc_type as usize, Ordering::Release);
}

type PyErrSetString = unsafe extern "C" fn(*mut c_void, *const c_char);
type PyGilStateCheck = unsafe extern "C" fn() -> c_int;

/// Raise a Python exception in the running interpreter, if there is one and we hold the GIL.
fn raise_python(oom: bool, msg: &str) -> bool {
    // SAFETY: dlsym lookups; the symbols have the CPython ABI types declared above. A
    // registered class is alive for the life of the process (gpupool_cupy_set_oom_error).
    unsafe {
        let set = libc::dlsym(libc::RTLD_DEFAULT, c"PyErr_SetString".as_ptr());
        let gil = libc::dlsym(libc::RTLD_DEFAULT, c"PyGILState_Check".as_ptr());
        let registered = if oom { OOM_ERROR.load(Ordering::Acquire) } else { 0 };
        let exc = if registered != 0 {
            registered as *mut c_void
        } else {
            let exc_name = if oom { c"PyExc_MemoryError" } else { c"PyExc_RuntimeError" };
            let var = libc::dlsym(libc::RTLD_DEFAULT, exc_name.as_ptr()) as *const *mut c_void;
            if var.is_null() {
                return false;
            }
            *var
        };
        if set.is_null() || gil.is_null() || exc.is_null() {
            return false;
        }
        let gil: PyGilStateCheck = std::mem::transmute(gil);
        if gil() == 0 {
            return false;
        }
        let set: PyErrSetString = std::mem::transmute(set);
        let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
        set(exc, c.as_ptr());
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
    if !GETTER_SETTLED.load(Ordering::Acquire) {
        discover_stream_getter();
    }
    call(|| {
        let r = front::malloc_for_cupy(device, size, current_stream());
        r.map(|a| out = a as *mut c_void).inspect_err(|e| err = Some(e.clone()))
    });
    if let Some(e) = err {
        let oom = matches!(e, Error::OutOfMemory(_));
        if !raise_python(oom, &e.to_string()) {
            crate::error::warn(&format!("{e} (from gpupool_cupy_malloc; no Python interpreter to raise in)"));
        }
    }
    out
}

/// `void free(void *param, void *ptr, int device)`: free on the block's allocation stream
/// (without a registered stream getter: free, then fence the legacy stream).
///
/// # Safety
/// No requirement beyond the C prototype.
#[no_mangle]
pub unsafe extern "C" fn gpupool_cupy_free(param: *mut c_void, ptr: *mut c_void, device: c_int) {
    let _ = param;
    let p = ptr as usize;
    call_void("gpupool_cupy_free", || {
        if STREAM_GETTER.load(Ordering::Relaxed) == 0 {
            return front::free_unordered(p, device);
        }
        // This thread's fast path holds only blocks it allocated on the legacy stream;
        // asked before the stream getter, which the fast path does without.
        if front::kept_by_thread_on_legacy(p, device) {
            return Ok(());
        }
        // The current stream is alive now: a block booked on it records its free there;
        // any other booked stream may have been destroyed since and is not touched.
        front::free_as_allocated(p, device, current_stream())
    });
}
