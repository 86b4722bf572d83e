//! Note [Sharing between processes]
//!
//! Rationale. Frameworks move GPU tensors between processes (an RL trainer feeding rollout
//! engines every step, data-loader workers, CuPy pipelines) and expect the memory itself to
//! travel, not a copy, to any receiver: another gpupool process, a process on PyTorch's own
//! allocator, one inside a container that refuses ptrace-class calls. The arena's memory
//! (the virtual memory API) is refused by `cudaIpcGetMemHandle`, so it needs a route of its
//! own; and receivers must never map memory the sender has since given to something else.
//!
//! Approach. A block travels as a *descriptor*: plain bytes naming the sender (pid, start
//! time), where it records its live exports, its handover socket, and per physical
//! allocation under the block the sender's file descriptor for it (an arena block), or the
//! CUDA IPC handle of the block's segment (a segment pool's block). The receiver obtains
//! the descriptors three ways, by preference: passed in by the caller (`SCM_RIGHTS`, the
//! frameworks' handovers), copied from the sender with `pidfd_getfd`, or, where that is
//! refused, asked of the sender's handover thread. Trust comes from the sender's export
//! record: an export is live while its random token is there, and a freed block's token is
//! cleared before any of its descriptors close. PyTorch's own formats wrap the descriptor so
//! that PyTorch's receivers read what they know.
//!
//! Implementation. Above the device pool, here: descriptors of either kind opened on a
//! device (`descriptor.rs`), PyTorch's formats (`torch_format.rs`), the handover thread
//! and its takers (`handover.rs`, `handover/`), the holds that tell a sender when the
//! frameworks' receivers let go (`holds.rs`), and spans of another process's memory mapped
//! once for many blocks (`spans.rs`). The pool checks and exports a block and maps an import
//! (`pool/ipc.rs`, the arena's export `pool/arena/export.rs`, the kept imports
//! `pool/import_cache.rs`); the upstream makes the driver calls and owns the descriptors'
//! bytes (`upstream/shared.rs` and `upstream/shared/`, the export record
//! `upstream/export_record.rs`, CUDA IPC handles `upstream/legacy_descriptor.rs`). The C
//! entry points are `ffi/ipc.rs`, `ffi/share.rs` (holds, imports as DLPack tensors),
//! `ffi/share_ahead.rs` (imports made while a message unpickles) and `ffi/handover.rs`;
//! Python's route is `python/gpupool/share.py`. docs/ipc.md is the user's contract.
//!
//! Limitations. Sender and receiver are processes of one user (or root) on one host, in one
//! network namespace where the handover socket is needed. An export ends when its block is
//! freed or its memory released (a pause): a receiver that still maps the memory keeps the
//! old allocation alive. A receiver on PyTorch's allocator opens an arena block only where
//! its allocations are of one size, and only with `pidfd_getfd` (not in a container).

pub mod descriptor;
pub mod handover;
pub mod holds;
pub mod spans;
pub mod torch_format;
