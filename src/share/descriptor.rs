//! A descriptor another process sent, of either kind: an arena block's granules
//! (`crate::share::protocol::GranuleDescriptor`) or a segment pool's CUDA IPC handle
//! (`crate::share::protocol::segment_descriptor`), told apart by its bytes, and opened on a device
//! through its pool.

use crate::error::{Error, Result};
use crate::registry;
use crate::share::protocol::SegmentDescriptor;
use crate::share::protocol::{GranuleDescriptor, OpenMark, FLAG_PAUSABLE};
use std::ffi::c_int;
use std::os::fd::AsRawFd;

/// A descriptor of either kind.
/// The longest descriptor of either kind (a granule descriptor of the most granules): a
/// longer length is refused before its bytes are read.
pub const MAX_BYTES: usize = crate::share::protocol::MAX_DESCRIPTOR_BYTES;

pub enum AnyDescriptor {
    Arena(GranuleDescriptor),
    Segment(SegmentDescriptor),
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
            AnyDescriptor::Arena(d) if fds.is_none() => match registry::with_pool(device, |pool| pool.importer().import(d, None)) {
                // No right to copy the exporter's descriptors (a container, Yama): its
                // handover thread hands them over instead, checked against its record.
                Err(Error::FetchRefused { detail, .. }) => {
                    let (handed, opens, record) = super::handover::take_export(d, &detail)?;
                    let raw: Vec<c_int> = handed.iter().map(|f| f.as_raw_fd()).collect();
                    // Memory its exporter may pause: counted as open there, with the opens
                    // file its handover thread sent, from before it is mapped until closed;
                    // the export must still be live once counted (a pause in between ended it).
                    let mark = match (d.flags & FLAG_PAUSABLE != 0, opens) {
                        (true, Some(opens)) => match OpenMark::new(opens.as_raw_fd(), d.record.slot, d.pid) {
                            Ok(m) => Some(m),
                            Err(e) if e.to_string().contains(OpenMark::PAUSING) => return Err(e),
                            Err(_) => None,
                        },
                        _ => None,
                    };
                    if mark.is_some() {
                        crate::share::protocol::still_handed(d, &record)?;
                    }
                    // The mapping keeps the memory: the copies close on return.
                    registry::with_pool(device, |pool| pool.importer().import_marked(d, Some(&raw), mark))
                }
                Ok(ptr) => {
                    if d.flags & FLAG_PAUSABLE != 0 {
                        // Kept idle after its close: the exporter's pause asks for it back.
                        super::keepers::watch();
                    }
                    Ok(ptr)
                }
                other => other,
            },
            AnyDescriptor::Arena(d) => registry::with_pool(device, |pool| pool.importer().import(d, fds)),
            AnyDescriptor::Segment(d) => registry::with_pool(device, |pool| pool.importer().import_segment(d)),
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
        if SegmentDescriptor::is_one(bytes) {
            return SegmentDescriptor::decode(bytes).map(AnyDescriptor::Segment);
        }
        GranuleDescriptor::decode(bytes).map(AnyDescriptor::Arena)
    }
}

/// Close what `AnyDescriptor::open` returned on `device` (the import at `ptr`).
pub fn close(device: c_int, ptr: usize) -> Result<()> {
    registry::with_pool(device, |pool| pool.importer().close(ptr))
}
