//! Everything `extern "C"`. Each export runs inside `boundary::call*`, which catches panics
//! (a panic crossing `extern "C"` would abort the host process), turns errors into a status
//! code and keeps this thread's detailed message for `gpupool_last_error`.
//!
//! - `core.rs`: the public C API (`gpupool_malloc`, `gpupool_free`, stats, limits, reports).
//! - `pinned.rs`: the pinned host pool.
//! - `torch.rs` + `torch_shim.cpp`: PyTorch's `CUDAPluggableAllocator` functions and hooks.
//! - `cupy.rs`: CuPy's `CFunctionAllocator` functions and its current-stream getter.
//! - `graph.rs`: private pools for CUDA graph captures from C.
//! - `ipc.rs`: sharing arena memory with other processes.
//! - `share.rs`: holds and DLPack imports for the frameworks' process-sharing routes.
//! - `share_ahead.rs`: a message's imports made on a thread of the library while it is unpickled.
//! - `handover.rs`: handing file descriptors to the process that unpickles a message.
//! - `report.rs`: errors of `void` entry points (stderr, once for invalid frees).

pub mod boundary;
pub mod core;
pub mod cupy;
pub mod graph;
pub mod handover;
pub mod ipc;
pub mod pinned;
pub mod report;
pub mod share;
pub mod share_ahead;
pub mod tags;
pub mod torch;
