//! The arena's granules under an exported block (`Pool::ipc_export`, `ipc.rs`, which checks
//! the pointer, guards the block and writes the record): the block's whole allocations, one
//! shareable descriptor per allocation, each granule named by its file's identity
//! (`crate::share::protocol`).

use crate::error::Result;
use crate::pool::core::Core;
use crate::share::protocol::{raise_fd_limit, FileId, SharedGranule};

/// The granules of `core`'s arena under `size` bytes at `ptr`, in entries of the device's
/// granularity: where they start, the entries' size and the entries. A failure (a driver
/// call) leaves the books as they were; a granule's descriptor stays with the upstream until
/// the granule is released and serves its next export.
pub(in crate::pool) fn granules(core: &mut Core, ptr: usize, size: usize) -> Result<(usize, usize, Vec<SharedGranule>)> {
    let g = arena_granule(core);
    // Each exported granule keeps a descriptor open (`crate::share::protocol::fds`).
    raise_fd_limit();
    // Whole allocations: the importer maps a chunk only whole.
    let (first, end) = extent(core, ptr, size);
    // Each granule's file identity goes along, so an importer can tell the exported file
    // from whatever its number names later (Note [Sharing between processes], "Trust").
    // (The granules of one allocation share its descriptor: one fstat for them.)
    let mut last: Option<(i32, FileId)> = None;
    // Entries of the device's granularity, which importers map in: a granule larger
    // than that (a tag's, Note [A tag's granule]) is several consecutive ones.
    let listed = listed_granule(core);
    let mut granules = Vec::with_capacity((end - first) / listed);
    for a in (first..end).step_by(g) {
        let s = core.upstream_mut().vmm_export(a)?;
        let file = match last {
            Some((fd, file)) if fd == s.fd => file,
            _ => FileId::of(s.fd)?,
        };
        last = Some((s.fd, file));
        granules.extend((0..g / listed).map(|k| SharedGranule { file, offset: s.offset + (k * listed) as u64, ..s }));
    }
    Ok((first, listed, granules))
}

/// How many entries an export of `size` bytes at `ptr` names (`None`: not an arena pool,
/// whose export is CUDA's segment handle).
pub(in crate::pool) fn granule_count(core: &Core, ptr: usize, size: usize) -> Option<usize> {
    core.arena()?;
    let (first, end) = extent(core, ptr, size);
    Some((end - first) / listed_granule(core))
}

fn arena_granule(core: &Core) -> usize {
    core.arena().expect("exports of granules are of arena pools").granule()
}

fn extent(core: &Core, ptr: usize, size: usize) -> (usize, usize) {
    core.arena().expect("exports of granules are of arena pools").export_extent(ptr, size)
}

/// The entries' size: the device's granularity (the arena's granule where the upstream does
/// not say).
fn listed_granule(core: &Core) -> usize {
    let g = arena_granule(core);
    match core.upstream().vmm_device_granule() {
        d if d == 0 || d > g || g % d != 0 => g,
        d => d,
    }
}
