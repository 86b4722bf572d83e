//! Errors: the one enum every layer returns, its stable numbered status for C, and the
//! message a user reads (`Display`).
//!
//! The status numbers are ABI: never renumber, only append.

use std::ffi::CStr;
use std::fmt;

/// Status code returned by every `gpupool_*` C function. `0` is success.
///
/// The numbers are stable across releases; new codes are only appended.
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Status {
    /// Success.
    Ok = 0,
    /// A required pointer argument was NULL.
    NullArgument = 1,
    /// An argument was out of range or malformed.
    InvalidArgument = 2,
    /// The pointer was not returned by this pool, was already freed, or points inside a block.
    InvalidPointer = 3,
    /// The device id is negative or no such device exists.
    InvalidDevice = 4,
    /// The request could not be satisfied within the device memory or the pool limit.
    OutOfMemory = 5,
    /// An environment variable or configuration value was malformed.
    InvalidConfig = 6,
    /// The CUDA driver library (libcuda) could not be loaded.
    NoDriver = 7,
    /// A CUDA driver call failed.
    CudaError = 8,
    /// A bug inside gpupool (a caught panic); the pool state was left as it was.
    Internal = 9,
    /// The operation is not possible in the pool's current state (e.g. reconfiguring a
    /// device that still has live allocations).
    Busy = 10,
    /// The pool cannot be used: it stopped after an internal error (its books may be
    /// wrong, so it hands out nothing more), or this process is a `fork()` child.
    Stopped = 11,
}

impl Status {
    /// Short constant description of the status (what `gpupool_status_str` returns).
    pub fn describe(self) -> &'static CStr {
        match self {
            Status::Ok => c"success",
            Status::NullArgument => c"a required pointer argument is NULL",
            Status::InvalidArgument => c"invalid argument",
            Status::InvalidPointer => c"pointer not owned by gpupool (unknown, interior, or already freed)",
            Status::InvalidDevice => c"invalid device id",
            Status::OutOfMemory => c"out of memory",
            Status::InvalidConfig => c"invalid configuration value",
            Status::NoDriver => c"no CUDA driver (libcuda) available",
            Status::CudaError => c"CUDA driver call failed",
            Status::Internal => c"internal error in gpupool (caught panic)",
            Status::Busy => c"operation not possible while allocations are live",
            Status::Stopped => c"pool stopped (after an internal error, or in a fork() child)",
        }
    }

    /// Every status, in numeric order (tests, `gpupool_status_str`).
    pub const ALL: [Status; 12] = [
        Status::Ok,
        Status::NullArgument,
        Status::InvalidArgument,
        Status::InvalidPointer,
        Status::InvalidDevice,
        Status::OutOfMemory,
        Status::InvalidConfig,
        Status::NoDriver,
        Status::CudaError,
        Status::Internal,
        Status::Busy,
        Status::Stopped,
    ];
}

/// Why a pointer handed to `free` was rejected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BadPointer {
    /// Never returned by this pool (and not inside any of its memory).
    Unknown,
    /// Inside a block that is currently allocated, but not its start.
    Interior { block_start: usize, block_size: usize },
    /// Points at memory the pool holds as free: freed twice, or freed after a reclaim.
    AlreadyFreed,
    /// Refused by a call other than free (IPC export and close), which says why.
    Refused(String),
}

/// Everything a user needs to act on an out-of-memory failure.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct OomReport {
    pub device: i32,
    pub requested: usize,
    /// Bytes the pool would have had to reserve to serve the request (after rounding).
    pub rounded: usize,
    pub reserved: usize,
    pub in_use: usize,
    pub cached: usize,
    pub largest_free_block: usize,
    /// 0 = no limit.
    pub limit: usize,
    /// Device free/total from the upstream (`cuMemGetInfo`), when it could be read.
    pub device_free_total: Option<(usize, usize)>,
    /// True when the pool limit, not the device, refused the request.
    pub by_limit: bool,
    /// Name of the active strategy, for the hint.
    pub strategy: &'static str,
    /// True when no release anywhere could help (the request is over the limit, or over
    /// what the arena could ever hold): the device's other shards keep their caches.
    pub hopeless: bool,
    /// The arena's mapping unit (its granule), 0 for the other pools: a limit counts whole
    /// granules, so a request smaller than one needs one.
    pub granule: usize,
    /// The arena found no room in its reserved address space (`GPUPOOL_ARENA_VA`): its
    /// size, which the hint names (the device may have memory to spare).
    pub address_space_full: Option<usize>,
}

/// The error type of the whole crate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Error {
    NullArgument(&'static str),
    InvalidArgument(String),
    InvalidPointer { ptr: usize, device: i32, why: BadPointer },
    InvalidDevice { device: i32, detail: String },
    OutOfMemory(Box<OomReport>),
    InvalidConfig { var: &'static str, value: String, accepted: &'static str },
    /// A well-formed setting that cannot be used (a trace path whose file cannot be
    /// created): the value, then why.
    UnusableConfig { var: &'static str, value: String, why: String },
    NoDriver(String),
    Cuda { call: &'static str, code: u32, name: String },
    Internal(String),
    Busy(String),
    /// The pool stopped handing out memory (see `Status::Stopped`); the text says why.
    Stopped(String),
    /// This process may not copy file descriptors out of exporter `pid` (`pidfd_getfd`
    /// refused: a container's seccomp profile, Yama's `ptrace_scope`, an old kernel). The
    /// sharing layer takes such imports through the exporter's handover socket instead;
    /// C callers see `GPUPOOL_STATUS_INVALID_ARGUMENT` with the text.
    FetchRefused { pid: u32, detail: String },
}

impl Error {
    /// The C status this error maps to.
    pub fn status(&self) -> Status {
        match self {
            Error::NullArgument(_) => Status::NullArgument,
            Error::InvalidArgument(_) => Status::InvalidArgument,
            Error::InvalidPointer { .. } => Status::InvalidPointer,
            Error::InvalidDevice { .. } => Status::InvalidDevice,
            Error::OutOfMemory(_) => Status::OutOfMemory,
            Error::InvalidConfig { .. } | Error::UnusableConfig { .. } => Status::InvalidConfig,
            Error::NoDriver(_) => Status::NoDriver,
            Error::Cuda { .. } => Status::CudaError,
            Error::Internal(_) => Status::Internal,
            Error::Busy(_) => Status::Busy,
            Error::Stopped(_) => Status::Stopped,
            Error::FetchRefused { .. } => Status::InvalidArgument,
        }
    }
}

/// Human-readable byte count: `1.50 GiB (1610612736 bytes)` style, short form.
pub fn human_bytes(n: usize) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// What an out-of-memory message starts with: PyTorch's own phrase, which batch-size finders
/// (HF accelerate's `should_reduce_batch_size`, Lightning's batch size scaler, toma) look for
/// in a `RuntimeError`'s text to tell "too big, try smaller" from a real failure. gpupool's
/// report follows it.
pub const CUDA_OOM_PHRASE: &str = "CUDA out of memory.";

impl fmt::Display for OomReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let h = human_bytes;
        write!(f, "{CUDA_OOM_PHRASE} gpupool: out of memory on device {}: tried to allocate {}", self.device, h(self.requested))?;
        if self.rounded != self.requested {
            write!(f, " (rounded to {})", h(self.rounded))?;
        }
        if self.by_limit {
            write!(f, ", which would exceed the pool limit of {}", h(self.limit))?;
            if self.granule > 0 {
                write!(f, " (the arena maps memory in whole granules of {})", h(self.granule))?;
            }
        }
        write!(f, ". ")?;
        match self.device_free_total {
            Some((free, total)) => write!(f, "Device: {} free of {} total. ", h(free), h(total))?,
            None => write!(f, "Device free/total: unknown. ")?,
        }
        write!(
            f,
            "Pool: {} reserved, {} in use, {} cached (largest free block {}), limit {}.",
            h(self.reserved),
            h(self.in_use),
            h(self.cached),
            h(self.largest_free_block),
            if self.limit == 0 { "none".to_string() } else { h(self.limit) }
        )?;
        // The hint names the knob that matches the situation.
        if self.device_free_total.is_some_and(|(_, total)| self.requested > total) {
            write!(f, " Hint: the request is larger than the whole device; check the size computation.")
        } else if self.by_limit {
            write!(f, " Hint: raise the limit (gpupool_set_limit / GPUPOOL_MEMORY_LIMIT) or free tensors/arrays you no longer need.")
        } else if let Some(va) = self.address_space_full {
            write!(
                f,
                " Hint: the arena's reserved address space ({} per range) has no room left for this request; raise GPUPOOL_ARENA_VA.",
                h(va)
            )
        } else if self.cached > 0 && self.largest_free_block < self.rounded {
            write!(
                f,
                " Hint: cached memory is fragmented; cached blocks were already released and retried. Free live memory, or try GPUPOOL_POOL={}.",
                if self.strategy == "split" { "binned" } else { "split" }
            )
        } else {
            write!(f, " Hint: free memory you no longer need, call gpupool_reclaim(), or set a lower GPUPOOL_MEMORY_LIMIT for other processes' sake.")
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::NullArgument(what) => write!(f, "gpupool: {what} must not be NULL"),
            Error::InvalidArgument(msg) => write!(f, "gpupool: invalid argument: {msg}"),
            Error::InvalidPointer { ptr, device, why } => match why {
                BadPointer::Unknown => write!(
                    f,
                    "gpupool: free of pointer {ptr:#x} on device {device}: this pointer was not allocated by gpupool on this device"
                ),
                BadPointer::Interior { block_start, block_size } => write!(
                    f,
                    "gpupool: free of pointer {ptr:#x} on device {device}: it points {} bytes inside the live block at {block_start:#x} ({} bytes); pass the pointer that malloc returned",
                    ptr - block_start,
                    block_size
                ),
                BadPointer::AlreadyFreed => write!(
                    f,
                    "gpupool: double free of pointer {ptr:#x} on device {device}: the block is already free"
                ),
                BadPointer::Refused(why) if *device < 0 => write!(f, "gpupool: pointer {ptr:#x}: {why}"),
                BadPointer::Refused(why) => write!(f, "gpupool: pointer {ptr:#x} on device {device}: {why}"),
            },
            Error::InvalidDevice { device, detail } => write!(f, "gpupool: invalid device {device}: {detail}"),
            Error::OutOfMemory(r) => write!(f, "{r}"),
            Error::InvalidConfig { var, value, accepted } => {
                write!(f, "gpupool: invalid value {value:?} for {var}; accepted: {accepted}")
            }
            Error::UnusableConfig { var, value, why } => write!(f, "gpupool: {var}={value:?} cannot be used: {why}"),
            Error::NoDriver(msg) => write!(f, "gpupool: no CUDA driver: {msg}"),
            Error::Cuda { call, code, name } => write!(f, "gpupool: CUDA driver call {call} failed: {name} ({code})"),
            Error::Internal(msg) => write!(f, "gpupool: internal error: {msg}"),
            Error::Busy(msg) => write!(f, "gpupool: {msg}"),
            Error::Stopped(msg) => write!(f, "gpupool: {msg}"),
            Error::FetchRefused { detail, .. } => write!(f, "gpupool: invalid argument: {detail}"),
        }
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

/// Write a line to stderr without ever panicking: `eprintln!` panics when stderr is closed
/// or broken, and a panic outside the boundary's guard would abort the host process.
pub fn warn(msg: &str) {
    use std::io::Write;
    let mut line = String::with_capacity(msg.len() + 1);
    line.push_str(msg);
    if !line.ends_with('\n') {
        line.push('\n');
    }
    let _ = std::io::stderr().write_all(line.as_bytes());
}

static LAST_PANIC: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

/// Remember the message of a panic the C boundary caught (the pool it interrupted reports it
/// when it stops).
pub fn set_last_panic(msg: &str) {
    if let Ok(mut p) = LAST_PANIC.lock() {
        *p = Some(msg.to_string());
    }
}

/// The message of the last panic caught at the C boundary, if any.
pub fn last_panic() -> Option<String> {
    LAST_PANIC.lock().ok().and_then(|p| p.clone())
}

/// The message a panic carried (`catch_unwind`'s payload), for the error that reports it.
pub fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}
