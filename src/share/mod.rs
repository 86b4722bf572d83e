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
//! allocation under the block the sender's file descriptor for it (an arena block: each
//! allocation is created with a POSIX descriptor as its shareable handle, and the receiver
//! maps them side by side in a range of its own), or the CUDA IPC handle of the block's
//! segment (a segment pool's block: the driver resolves the handle, no descriptor travels).
//! The receiver obtains the sender's file descriptors three ways, by preference: passed in
//! by the caller (`SCM_RIGHTS`, the frameworks' handovers; the kernel passes at most 253 in
//! one message, so a larger block goes in several), copied from the sender with
//! `pidfd_getfd` (Linux 5.6+ and the right to ptrace the sender) one allocation at a time,
//! so a block of thousands never holds more than one fetched descriptor open, or, where
//! that is refused (containers, Yama), asked of the sender's handover thread. The sender
//! keeps each exported allocation's descriptor open (close-on-exec) while the allocation
//! is mapped, so it stays fetchable while the block lives. PyTorch's own formats wrap the
//! descriptor so that PyTorch's receivers read what they know.
//!
//! Trust. A descriptor names descriptor numbers in another process, and numbers are reused:
//! a stale descriptor (its block freed, the number since given to another file), a reused
//! pid or a forged one (a client steering a privileged importer) would map memory nobody
//! exported. So the descriptor binds what it names: the sender's start time (a reused pid
//! is a process started later) and each allocation's file identity (device and inode, as
//! `fstat` gives them at export), checked on every descriptor mapped, fetched or passed in.
//! File identity alone does not tell the driver's exported descriptors apart (each is an
//! open of `/dev/nvidiactl`), so the sender also keeps a record of its live exports: a
//! sealed `memfd` with a random token per export beside the digest of its allocation list,
//! cleared before any allocation of the export is released and its descriptor closed. An
//! importer fetching by pid fetches the record too, checks that it is the sender's (magic,
//! pid, start time), that the slot still holds the token and the digest of the descriptor's
//! list (entries changed after export are refused), and checks again after each descriptor
//! it fetches: one fetched while its export's token was there is that export's. A freed
//! block ends its exports before its memory can serve another allocation; a pause ends them
//! by releasing the memory. Beside the record, the *opens file* counts the imports receivers
//! hold open of memory the sender may pause (a tag's), so a pause refuses while one is open,
//! and lists the receivers that keep idle mappings of it (keepers), which a pause wakes and
//! waits for to let go.
//!
//! Implementation. Everything about sharing lives here, in three layers of its own:
//! - `protocol/`, below the driver layer: the descriptors' bytes (`granule_descriptor.rs`,
//!   `segment_descriptor.rs`), what names shared memory (`identity.rs`), the export record
//!   and the opens file (`record.rs`, `opens_file.rs`), an importer's mark in it
//!   (`open_mark.rs`), how an importer gets the sender's descriptors (`exporter.rs`), and
//!   this process's descriptors for shared memory (`fds.rs`). No driver call is made there.
//! - the device pool's sharing books, beside the upstream: an exporter's exports by block
//!   (`exports.rs`: reused by a block sent again, ended when it is freed), an importer's
//!   kept mappings (`import_cache.rs`, Note [Keeping imports mapped]) and what an import
//!   and a close of another process's block decide (`imports.rs`: the descriptors used,
//!   the open count, a kept mapping or a new one), the pool's upstream making the calls.
//! - above the registry: exporting a block of any device (`export.rs`), a received
//!   descriptor of either kind opened on a device (`descriptor.rs`), PyTorch's formats
//!   (`torch_format.rs`, Note [PyTorch's handle formats]), the handover thread and its
//!   takers (`handover.rs`, `handover/`), the holds that tell a sender when the frameworks'
//!   receivers let go (`holds.rs`), spans of another process's memory mapped once for many
//!   blocks (`spans.rs`), an import handed to a framework (`received.rs`), imports opened
//!   while a message unpickles (`ahead.rs`), and the keepers' side of a pause: a receiver's
//!   thread that drops the kept mappings its senders' pauses ask back, and a sender's wait
//!   for its keepers (`keepers.rs`).
//!
//! The rest of the library offers narrow hooks: the pool checks a pointer against its books,
//! exports a block and writes its record (`pool/ipc.rs`; an arena block's granules:
//! `pool/arena/export.rs`), and for imports lends its kept imports, its upstream and
//! whether it stopped to `imports.rs`'s `Importer` (`Pool::importer`); the
//! arena strategy sets an exported block's granules aside (`strategy/arena/export.rs`)
//! and never touches the record; the upstreams make the driver calls (`upstream/ipc.rs`,
//! `upstream/cuda/address_space/import.rs`, `upstream/cuda/ipc_handles.rs`) and count each
//! release of an exported allocation in the record. The C entry points only marshal
//! (`ffi/ipc.rs`, `ffi/share.rs`, `ffi/share_ahead.rs`, `ffi/handover.rs`); Python's route is
//! `python/gpupool/share.py`. docs/ipc.md is the user's contract.
//!
//! Limitations. Sender and receiver are processes of one user (or root) on one host, in one
//! network namespace where the handover socket is needed. An export ends when its block is
//! freed or its memory released (a pause): a receiver that still maps the memory keeps the
//! old allocation alive: one that keeps a block of it open after the sender freed the block
//! (which ended its export and its count), or a keeper that does not answer the pause's
//! wake within `keepers::KEEPERS_WAIT`. A sender has 255 keeper entries; a receiver past them
//! unmaps its idle mappings of that sender's pausable memory at their last close. A receiver on PyTorch's allocator opens an arena block only where
//! its allocations are of one size, and only with `pidfd_getfd` (not in a container).

pub mod ahead;
pub mod descriptor;
pub mod export;
pub mod exports;
pub mod handover;
pub mod holds;
pub mod import_cache;
pub mod keepers;
pub mod imports;
pub mod protocol;
pub mod received;
pub mod spans;
pub mod torch_format;
