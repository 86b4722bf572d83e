//! What passes between an exporting and an importing process, below the driver layer:
//! the descriptors' bytes (`granule_descriptor`: an arena block's allocations;
//! `segment_descriptor`: a segment pool's CUDA IPC handle), what names shared memory
//! (`identity`), the exporter's record of its live exports and the opens file beside it
//! (`record`, `opens_file`), an importer's mark in that file (`open_mark`), how an importer
//! gets the exporter's file descriptors (`exporter`), and this process's descriptors for
//! shared memory (`fds`). No driver call is made here: the upstreams import from this
//! layer (a granule's descriptor, the release count they keep), the pool and the
//! import cache above them use it. Note [Sharing between processes] (`share/mod.rs`)
//! is the whole mechanism.

pub mod exporter;
pub mod fds;
pub mod granule_descriptor;
pub mod identity;
pub mod open_mark;
pub mod opens_file;
pub mod record;
pub mod segment_descriptor;

pub use exporter::{check_handed, still_handed, still_the_exporter, Exporter, FdSource};
pub use fds::{hold_cloexec_window, new_fd_cloexec, raise_fd_limit, set_cloexec};
pub use granule_descriptor::{
    GranuleDescriptor, FLAG_PAUSABLE, GRANULE_BYTES, HEADER_BYTES, KIND_CUDA, KIND_HOST, MAX_DESCRIPTOR_BYTES, MAX_GRANULES,
};
pub use identity::{granules_digest, own_start_time, start_time_of, Fd, FileId, SharedGranule};
pub use open_mark::{keepers, Keeper, OpenMark};
pub use record::{ExportRecord, RecordRef};
pub use segment_descriptor::{SegmentDescriptor, SEGMENT_DESCRIPTOR_BYTES};

#[cfg(test)]
mod tests;
