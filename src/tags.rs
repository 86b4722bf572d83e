//! Tags: names a thread allocates under (`gpupool_tag_begin` / `gpupool.tag(...)`), so
//! that what it allocates can be paused and resumed apart from everything else
//! (`docs/tags.md`). Each tag's allocations come from a pool of their own on each device
//! (the registry's tag shards), so a tag's memory is whole granules no other tag or
//! untagged allocation shares.
//!
//! This module holds the process's tag names (at most `MAX_TAGS`, kept for the process's
//! life: a tag's index names its shard) and each thread's current tag, a stack so that
//! tags nest as `with` blocks do.

use crate::error::{Error, Result};
use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Mutex;

/// Tags a process may name.
pub const MAX_TAGS: usize = 16;

/// The longest tag name, in bytes.
pub const MAX_NAME: usize = 64;

// Note [A tag's granule]
//
// Rationale. A tag holds what a process sends to others and puts to sleep: a trainer's
// weights, an engine's KV cache. Both cost per physical allocation, not per byte: an
// export makes one shareable descriptor per allocation, a receiver imports, maps and
// grants each, and a pause and a resume unmap, release, create and map each. At the
// device's 2 MiB granularity a 2 GB state dict is a thousand allocations, and its first
// send costs several times what CUDA's IPC handles of PyTorch's segments cost. A
// receiver on PyTorch's own allocator opens an arena block only where its memory is
// allocations of one size (PyTorch's expandable segment, Note [PyTorch's handle formats]).
//
// Approach. A tag's pool is an arena whose granule is `TAG_GRANULE`, a power-of-two
// multiple of the device's: every allocation under a tag is that size, so every tagged
// block has PyTorch's form, and a tag's memory is a sixteenth as many allocations as at
// 2 MiB. Blocks are still carved at 512 B from that memory, so blocks pack as they do in
// the default pool; what a larger granule costs is its unused parts: the last granule of
// each of the tag's ranges (small, large), and, where the tag's shapes keep changing,
// granules that frees leave partly used, which the arena can neither give back nor
// stitch (a stitch moves whole free granules).
//
// Implementation. `crate::registry` (`create`) gives a tag shard `PoolOptions::
// arena_granule` and no chunks; the arena asks its upstream for that granule
// (`VirtualMemory::vmm_set_granule`), which then creates, maps, aliases, pauses and
// exports in that unit. Exports still list the device's granularity
// (`vmm_device_granule`): a granule of the tag is several consecutive entries of one
// descriptor, so every importer, whatever its own pools' granule, maps it whole.
//
// Limitations. A tag that holds little still maps a whole granule per range in use, and
// one whose shapes churn holds more above its peak than the default pool does (a few
// granules on the replayed workloads: `tests/replay.rs`, docs/benchmarks.md). 32 MiB is
// PyTorch's 20 MiB segment rounded to a power of two (the arena's granules are); what
// goes in a tag is meant to be long-lived and large: weights, KV caches, send buffers.
// Untagged arena blocks over mixed allocations keep gpupool's own format (docs/ipc.md).

/// The granule of a tag's pool (Note [A tag's granule]).
pub const TAG_GRANULE: usize = 32 << 20;

/// What memory a tag's pool is made of (`gpupool_tag_place`, Note [A tag's memory]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum TagMemory {
    /// Virtual memory mapped by an arena (the default): a pause gives it back and keeps its
    /// addresses; it is sent as PyTorch's expandable segments.
    Pausable = 0,
    /// `cuMemAlloc` segments under the `split` strategy: sent as CUDA's IPC handles, which
    /// any receiver opens, in any container; it cannot be paused.
    CudaIpc = 1,
}

impl TagMemory {
    pub const ACCEPTED: &'static str = "pausable | cuda-ipc";

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "pausable" => Some(TagMemory::Pausable),
            "cuda-ipc" => Some(TagMemory::CudaIpc),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            TagMemory::Pausable => "pausable",
            TagMemory::CudaIpc => "cuda-ipc",
        }
    }
}

// Note [A tag's memory]
//
// Rationale. An RL trainer sends its weights to rollout engines. An engine on PyTorch's
// own allocator opens a tag's virtual memory (PyTorch's expandable-segment form) only by
// copying the sender's descriptors with `pidfd_getfd`, which a container without
// CAP_SYS_PTRACE refuses, as it does for PyTorch's own expandable segments. CUDA's IPC
// handles of `cuMemAlloc` memory need no such right, but memory from `cuMemAlloc` cannot
// be given back at a kept address, so it cannot be paused.
//
// Approach. The caller chooses per tag, before the tag's first allocation on a device:
// pausable (the arena over virtual memory, the default) or cuda-ipc (the `split` strategy
// over `cuMemAlloc`, whose blocks the allocator class sends as CUDA IPC handles). A
// trainer keeps its weights in a pausable tag and copies what it sends into a cuda-ipc
// tag (a bucket), which it frees, rather than pauses, before it sleeps.
//
// Implementation. The choice is a byte per tag here; the registry reads it when it makes
// the tag's pool on a device (`registry::create`) and refuses a change while a pool of the
// tag holds memory (`registry::place_tag`). A pause of a cuda-ipc tag is refused naming
// the choice.
//
// Limitations. A device whose upstream is the host (tests, the demo) makes a cuda-ipc
// tag's pool a `split` pool over host memory: the same books, no CUDA handles.

static NAMES: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Each tag's `TagMemory`, by index.
static MEMORY: [AtomicU8; MAX_TAGS] = [const { AtomicU8::new(TagMemory::Pausable as u8) }; MAX_TAGS];

/// What tag `index`'s memory is made of.
pub fn memory(index: usize) -> TagMemory {
    match MEMORY.get(index).map(|m| m.load(Ordering::Acquire)) {
        Some(1) => TagMemory::CudaIpc,
        _ => TagMemory::Pausable,
    }
}

/// Tag `index`'s memory is made of `kind` from its next pool on (`registry::place_tag`
/// checks that none holds memory).
pub fn set_memory(index: usize, kind: TagMemory) {
    if let Some(m) = MEMORY.get(index) {
        m.store(kind as u8, Ordering::Release);
    }
}

thread_local! {
    /// This thread's tag: its index + 1, or 0 for none (one load on the allocation path).
    static CURRENT: Cell<usize> = const { Cell::new(0) };
    /// The tags `begin` replaced, innermost last.
    static OUTER: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

fn names() -> std::sync::MutexGuard<'static, Vec<String>> {
    NAMES.lock().unwrap_or_else(|p| p.into_inner())
}

fn check_name(name: &str) -> Result<()> {
    if name.is_empty() || name.len() > MAX_NAME || name.chars().any(|c| c.is_control()) {
        return Err(Error::InvalidArgument(format!(
            "tag {name:?}: a tag is a name of 1 to {MAX_NAME} bytes without control characters"
        )));
    }
    Ok(())
}

/// The index of tag `name`, named now if it is new.
pub fn index_of(name: &str) -> Result<usize> {
    check_name(name)?;
    let mut n = names();
    if let Some(i) = n.iter().position(|t| t == name) {
        return Ok(i);
    }
    if n.len() == MAX_TAGS {
        return Err(Error::InvalidArgument(format!(
            "tag {name:?}: this process named {MAX_TAGS} tags already ({}), the most it may",
            n.join(", ")
        )));
    }
    n.push(name.to_string());
    Ok(n.len() - 1)
}

/// The index of tag `name` if it was ever named.
pub fn lookup(name: &str) -> Option<usize> {
    names().iter().position(|t| t == name)
}

/// Every tag this process named, in the order named, with what its memory is made of.
pub fn all() -> Vec<(String, TagMemory)> {
    names().iter().enumerate().map(|(i, n)| (n.clone(), memory(i))).collect()
}

/// The name of tag `index`.
pub fn name(index: usize) -> Option<String> {
    names().get(index).cloned()
}

/// From now on this thread allocates under tag `name` (until the matching `end`).
pub fn begin(name: &str) -> Result<()> {
    let i = index_of(name)?;
    let outer = CURRENT.with(|c| c.replace(i + 1));
    OUTER.with(|o| o.borrow_mut().push(outer));
    Ok(())
}

/// End this thread's innermost tag: it allocates under the tag outside it again.
pub fn end() -> Result<()> {
    let Some(outer) = OUTER.with(|o| o.borrow_mut().pop()) else {
        return Err(Error::InvalidArgument("tag end: this thread has no tag begun".into()));
    };
    CURRENT.with(|c| c.set(outer));
    Ok(())
}

/// This thread's tag index, if it allocates under one.
#[inline]
pub fn current() -> Option<usize> {
    CURRENT.with(|c| c.get().checked_sub(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_nest_per_thread_and_names_are_checked() {
        assert_eq!(current(), None);
        begin("unit-a").unwrap();
        let a = current().unwrap();
        begin("unit-b").unwrap();
        assert_ne!(current(), Some(a));
        std::thread::spawn(|| assert_eq!(current(), None, "another thread has no tag")).join().unwrap();
        end().unwrap();
        assert_eq!(current(), Some(a));
        end().unwrap();
        assert_eq!(current(), None);
        assert!(end().is_err(), "an end without a begin is refused");
        assert!(begin("").is_err());
        assert!(begin(&"x".repeat(MAX_NAME + 1)).is_err());
        assert_eq!(lookup("unit-a"), Some(a));
        assert_eq!(name(a).as_deref(), Some("unit-a"));
    }
}
