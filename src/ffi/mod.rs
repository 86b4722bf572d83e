//! Everything `extern "C"`. Each export runs inside `boundary::call*`, which catches panics
//! (a panic crossing `extern "C"` would abort the host process), turns errors into a status
//! code and keeps this thread's detailed message for `gpupool_last_error`.
//!
//! - `core.rs`: the public C API (`gpupool_malloc`, `gpupool_free`, stats, limits, reports).
//! - `pinned.rs`: the pinned host pool.

pub mod boundary;
pub mod core;
pub mod pinned;
