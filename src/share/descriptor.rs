//! A descriptor another process sent, of either kind: an arena block's granules
//! (`crate::upstream::shared::Descriptor`) or a segment pool's CUDA IPC handle
//! (`crate::upstream::legacy_descriptor`), told apart by its bytes, and opened on a device
//! through its pool.

use crate::error::{Error, Result};
use crate::registry;
use crate::upstream::legacy_descriptor::LegacyDescriptor;
use crate::upstream::shared::{Descriptor, FileId, SharedGranule, KIND_CUDA};
use super::torch_format::{self, Parsed};
use std::ffi::c_int;
use std::os::fd::{AsRawFd, FromRawFd};

/// A descriptor of either kind.
pub enum AnyDescriptor {
    Arena(Descriptor),
    Segment(LegacyDescriptor),
}

impl AnyDescriptor {
    /// The file descriptors behind it (one per granule; none for a segment's handle).
    pub fn fds(&self) -> Vec<i32> {
        match self {
            AnyDescriptor::Arena(d) => d.granules.iter().map(|g| g.fd).collect(),
            AnyDescriptor::Segment(_) => Vec::new(),
        }
    }

    /// Map it on `device`: `fds` as `gpupool_ipc_open` takes them (checked by the pool).
    pub fn open(&self, device: c_int, fds: Option<&[c_int]>) -> Result<usize> {
        if let (AnyDescriptor::Segment(_), Some(f)) = (self, fds) {
            if !f.is_empty() {
                return Err(Error::InvalidArgument(format!(
                    "IPC import: {} descriptors passed for a segment pool's block, which has none",
                    f.len()
                )));
            }
        }
        match self {
            AnyDescriptor::Arena(d) if fds.is_none() => match registry::with_pool(device, |pool| pool.ipc_import(d, None)) {
                // No right to copy the exporter's descriptors (a container, Yama): its
                // handover thread hands them over instead, checked against its record.
                Err(Error::FetchRefused { detail, .. }) => {
                    let handed = super::handover::take_export(d, &detail)?;
                    let raw: Vec<c_int> = handed.iter().map(|f| f.as_raw_fd()).collect();
                    // The mapping keeps the memory: the copies close on return.
                    registry::with_pool(device, |pool| pool.ipc_import(d, Some(&raw)))
                }
                other => other,
            },
            AnyDescriptor::Arena(d) => registry::with_pool(device, |pool| pool.ipc_import(d, fds)),
            AnyDescriptor::Segment(d) => registry::with_pool(device, |pool| pool.ipc_import_legacy(d)),
        }
    }

    /// The block's size.
    pub fn size(&self) -> u64 {
        match self {
            AnyDescriptor::Arena(d) => d.size,
            AnyDescriptor::Segment(d) => d.size,
        }
    }
}

impl AnyDescriptor {
    /// The descriptor in `bytes`, of whichever kind its bytes say.
    pub fn decode(bytes: &[u8]) -> Result<AnyDescriptor> {
        if LegacyDescriptor::is_one(bytes) {
            return LegacyDescriptor::decode(bytes).map(AnyDescriptor::Segment);
        }
        Descriptor::decode(bytes).map(AnyDescriptor::Arena)
    }
}

/// Open a handle an allocator class made in `shareIpcHandle` (`torch_format.rs`) on
/// `device`: (the address PyTorch adds the storage's offset to, the address
/// `gpupool_ipc_close` takes).
pub fn open_torch(handle: &[u8], device: c_int) -> Result<(usize, usize)> {
    match torch_format::decode(handle)? {
        Parsed::Library { descriptor, offset } => {
            let block = AnyDescriptor::decode(descriptor)?.open(device, None)?;
            Ok((block - offset as usize, block))
        }
        Parsed::CudaIpc(h) => {
            // PyTorch's own segment: the storage's offset travels apart; the segment opens whole.
            let base = registry::with_pool(device, |pool| pool.ipc_import_legacy(&LegacyDescriptor { pid: 0, device, start_time: 0, handle: h, offset: 0, size: 0 }))?;
            Ok((base, base))
        }
        Parsed::Expandable { pid, segment_size, fds } => {
            let base = open_expandable(pid, segment_size, &fds, device)?;
            Ok((base, base))
        }
    }
}

/// Map an expandable segment a process on PyTorch's own allocator shared: its allocations
/// (`segment_size` each, behind the sender's descriptors `theirs`) copied with
/// `pidfd_getfd`, as PyTorch's receiver does, and mapped side by side as an import of
/// granule-sized pieces. Such a sender keeps no export record: the copies are trusted as
/// PyTorch's receiver trusts them.
fn open_expandable(pid: u32, segment_size: u64, theirs: &[i32], device: c_int) -> Result<usize> {
    const GRANULE: u64 = 2 << 20;
    if segment_size % GRANULE != 0 {
        return Err(Error::InvalidArgument(format!(
            "IPC import: PyTorch's expandable segment of {segment_size}-byte pages is not a whole number of {GRANULE}-byte granules"
        )));
    }
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if pidfd < 0 {
        return Err(Error::InvalidArgument(format!(
            "IPC import: pidfd_open of process {pid} failed: {} (the sender, on PyTorch's expandable segments, has exited?)",
            std::io::Error::last_os_error()
        )));
    }
    let pidfd = unsafe { std::os::fd::OwnedFd::from_raw_fd(pidfd as i32) };
    let mut mine = Vec::with_capacity(theirs.len());
    let mut granules = Vec::new();
    for (i, &fd) in theirs.iter().enumerate() {
        let got = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
        if got < 0 {
            return Err(Error::InvalidArgument(format!(
                "IPC import: pidfd_getfd of descriptor {fd} of process {pid} failed: {}. The sender is on PyTorch's \
                 expandable segments, whose receivers copy its descriptors (a container without CAP_SYS_PTRACE refuses \
                 that, for PyTorch's own receivers too): turn expandable segments off in the sender, or install gpupool \
                 in both processes (gpupool's handles reach gpupool receivers in containers)",
                std::io::Error::last_os_error()
            )));
        }
        let got = unsafe { std::os::fd::OwnedFd::from_raw_fd(got as i32) };
        let file = FileId::of(got.as_raw_fd())?;
        for k in 0..segment_size / GRANULE {
            granules.push(SharedGranule { fd: i as i32, offset: k * GRANULE, file });
        }
        mine.push(got);
    }
    let d = Descriptor {
        kind: KIND_CUDA,
        pid,
        start_time: 0,
        record: Default::default(),
        device,
        granule: GRANULE,
        offset: 0,
        size: segment_size * theirs.len() as u64,
        origin: 0,
        handover: 0,
        flags: 0,
        granules,
    };
    let raw: Vec<c_int> = mine.iter().map(|f| f.as_raw_fd()).collect();
    registry::with_pool(device, |pool| pool.ipc_import(&d, Some(&raw)))
}
