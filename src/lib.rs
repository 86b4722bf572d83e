//! gpupool: a caching GPU memory pool with a C ABI, shared in one process by CuPy,
//! PyTorch and C/C++ CUDA programs.
//!
//! Module map:
//! - `error`: the error enum, C status codes, user-facing messages.
//! - `config`: the only reader of environment variables.
//! - `block`: blocks, segments, split/merge rules.
//! - `strategy`: caching policies (`split`, `binned`, `none`, `arena`: the virtual-memory
//!   arena, whose driver calls live in `pool/grow.rs`, `pool/release.rs` and, for
//!   exports, `pool/arena/export.rs`).
//! - `upstream`: where raw memory comes from (`host`, CUDA `device`/`vmm`/`managed`/`async`/`pinned`),
//!   the virtual memory API the arena maps with, and the count of driver calls by kind.
//! - `stream`: stream identity and the cross-stream reuse rule.
//! - `stats`: counters and the status/JSON reports.
//! - `pool`: one device's pool (escalation, limits, live-pointer map); `pool/release.rs`
//!   gives memory back (segments, decommitted pages, the arena's granules).
//! - `decay`: how much cached memory to keep (the recent in-use peak).
//! - `pages`: the books of pages decommitted inside segments.
//! - `registry`: per-device pools, created lazily, in shards with a lock each (user
//!   streams spread over them) that share the device's budget; device-wide reports.
//! - `front`: where every allocation and free begins; the one out-of-memory retry.
//! - `thread_cache`: the per-thread fast path for same-size reuse on one stream (every
//!   stream but the per-thread default one), all of it: the thread-local side, the
//!   attach on a locked allocation, and `state/`, the words a cache shares with its pool
//!   (a layer below the pool; `Pool::attach_thread` and the kept blocks' return in
//!   `pool/free.rs` are the pool's interface).
//! - `debug`: leak records and the leak report (`GPUPOOL_DEBUG`).
//! - `trace`: the CSV event trace (`GPUPOOL_TRACE`); `replay` plays one back.
//! - `owners`: which device's pool got an address range (lookups without pool locks).
//! - `process`: the fork-child flag and at-exit hooks (a leaf every layer may use).
//! - `socket`: socket writes that raise no SIGPIPE (a leaf).
//! - `fork`: `pthread_atfork` handlers; a fork child gets a clear error.
//! - `share`: sharing blocks between processes above the device pool (received
//!   descriptors, spans mapped once, the holds file, the descriptor handover).
//! - `status_socket`: the status report for other processes (`GPUPOOL_STATUS_SOCKET`).
//! - `tags`: tag names and each thread's current tag (a tag's memory is a pool of its own,
//!   which pauses and resumes apart: `registry/tags.rs`, `docs/tags.md`).
//! - `ffi`: every `extern "C"` function.

pub mod block;
pub mod config;
pub mod debug;
pub mod decay;
pub mod error;
pub mod pages;
pub mod fork;
pub mod front;
pub mod ffi;
pub mod owners;
pub mod pool;
pub mod process;
pub mod registry;
pub mod replay;
pub mod share;
pub mod socket;
pub mod stats;
pub mod status_socket;
pub mod strategy;
pub mod stream;
pub mod tags;
pub mod thread_cache;
pub mod trace;
pub mod upstream;

pub use error::{Error, Status};
pub use pool::{Pool, PoolOptions};
pub use stats::Stats;
