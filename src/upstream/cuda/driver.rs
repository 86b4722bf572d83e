//! The driver itself: is libcuda there (checked once, before any cudarc call, because
//! every cudarc call panics without it), `cuInit`, device count, error conversion, and the
//! device's primary context with a guard that makes it current only for the duration of
//! our calls (never leaving the caller's thread on another context).

use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::sync::OnceLock;

static DRIVER: OnceLock<std::result::Result<(), Error>> = OnceLock::new();

/// Load libcuda and `cuInit(0)` once per process; the answer is cached.
pub fn ensure_driver() -> Result<()> {
    DRIVER
        .get_or_init(|| {
            // SAFETY: only tries to dlopen candidate names.
            if !unsafe { sys::is_culib_present() } {
                let mut looked = cudarc::get_lib_name_candidates("cuda");
                let mut seen = std::collections::HashSet::new();
                looked.retain(|n| seen.insert(n.clone())); // the candidate list repeats names
                return Err(Error::NoDriver(format!(
                    "could not load the CUDA driver library (looked for {}); install the NVIDIA driver",
                    looked.join(", ")
                )));
            }
            check("cuInit", unsafe { sys::cuInit(0) }).map_err(|e| match e {
                Error::Cuda { code, name, .. } if name.contains("NO_DEVICE") => {
                    Error::NoDriver(format!("cuInit found no CUDA device ({name}, {code})"))
                }
                other => other,
            })
        })
        .clone()
}

pub fn cuda_error(call: &'static str, code: sys::CUresult) -> Error {
    Error::Cuda { call, code: code as u32, name: format!("{code:?}") }
}

pub fn check(call: &'static str, code: sys::CUresult) -> Result<()> {
    if code == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(cuda_error(call, code))
    }
}

/// Number of CUDA devices (after `ensure_driver`).
pub fn device_count() -> Result<i32> {
    ensure_driver()?;
    let mut n = 0;
    check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
    Ok(n)
}

/// Fail with `InvalidDevice` unless `device` names an existing CUDA device.
pub fn validate_device(device: i32) -> Result<()> {
    let n = device_count()?;
    if device < 0 || device >= n {
        return Err(Error::InvalidDevice { device, detail: format!("this machine has {n} CUDA device(s): valid ids are 0..{}", n - 1) });
    }
    Ok(())
}

/// A device's primary context: the one the CUDA runtime, PyTorch and CuPy use.
pub struct PrimaryContext {
    pub ctx: sys::CUcontext,
    pub device: sys::CUdevice,
}

impl PrimaryContext {
    pub fn retain(device: i32) -> Result<Self> {
        validate_device(device)?;
        let mut dev: sys::CUdevice = 0;
        check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut dev, device) })?;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        check("cuDevicePrimaryCtxRetain", unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) })?;
        Ok(PrimaryContext { ctx, device: dev })
    }

    /// Make the primary context current for this scope if it is not already.
    pub fn enter(&self) -> Result<CtxGuard> {
        let mut cur: sys::CUcontext = std::ptr::null_mut();
        check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut cur) })?;
        if cur == self.ctx {
            return Ok(CtxGuard { pushed: false });
        }
        check("cuCtxPushCurrent", unsafe { sys::cuCtxPushCurrent_v2(self.ctx) })?;
        Ok(CtxGuard { pushed: true })
    }
}

impl Drop for PrimaryContext {
    fn drop(&mut self) {
        unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
    }
}

/// Pops the context pushed by `enter`, restoring the caller's.
pub struct CtxGuard {
    pushed: bool,
}

impl Drop for CtxGuard {
    fn drop(&mut self) {
        if self.pushed {
            let mut old: sys::CUcontext = std::ptr::null_mut();
            unsafe { sys::cuCtxPopCurrent_v2(&mut old) };
        }
    }
}

/// Relaxed stream-capture mode for this thread while it lives (`cuThreadExchangeStreamCaptureMode`),
/// the previous mode restored on drop. Inactive (no driver call) when not asked for.
pub struct RelaxedCapture(Option<sys::CUstreamCaptureMode>);

impl RelaxedCapture {
    pub fn enter(active: bool) -> RelaxedCapture {
        if !active {
            return RelaxedCapture(None);
        }
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: exchanges this thread's mode; `mode` receives the previous one.
        match unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) } {
            sys::CUresult::CUDA_SUCCESS => RelaxedCapture(Some(mode)),
            _ => RelaxedCapture(None),
        }
    }
}

impl Drop for RelaxedCapture {
    fn drop(&mut self) {
        if let Some(mut mode) = self.0.take() {
            // SAFETY: restores the mode saved by `enter`.
            unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
        }
    }
}
