//! Sharing blocks between processes: the parts above the device pool, in one place.
//!
//! - `descriptor.rs`: a received descriptor of either kind, decoded and opened through the
//!   pool of its device;
//! - `spans.rs`: spans of another process's allocations mapped once for every held block in
//!   them;
//! - `holds.rs`: the holds file, where an importer says it still uses a block, so that its
//!   exporter keeps it (the frameworks' routes);
//! - `handover.rs` and `handover/`: handing file descriptors to the process that unpickles a
//!   message, and to an importer that may not copy an exporter's descriptors itself;
//! - `torch_format.rs`: PyTorch's own handle formats, with gpupool's descriptor behind them.
//!
//! The parts below live in the layer they belong to: the pool checks and exports a block
//! and maps an import (`pool/ipc.rs`, the arena's export `pool/arena/export.rs`, the kept
//! imports `pool/import_cache.rs`); the upstream makes the driver calls and owns the
//! descriptors' bytes (`upstream/shared.rs` and `upstream/shared/`, the exporter's record
//! `upstream/export_record.rs`, CUDA IPC handles `upstream/legacy_descriptor.rs`). The C
//! entry points are `ffi/ipc.rs`, `ffi/share.rs` (holds, imports as DLPack tensors),
//! `ffi/share_ahead.rs` (imports made while a message unpickles) and `ffi/handover.rs`;
//! Python's route is `python/gpupool/share.py`. The design note is docs/ipc.md.

pub mod descriptor;
pub mod handover;
pub mod holds;
pub mod spans;
pub mod torch_format;
