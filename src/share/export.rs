//! Exporting a live block, whichever device's pool holds it: the descriptor names this
//! process's handover socket (an importer that may not copy this process's descriptors
//! asks its handover thread for them), and a tag's block says that its memory may be
//! paused (its importers then count their opens, and give kept mappings back when a
//! pause asks).

use super::protocol::FLAG_PAUSABLE;
use super::torch_format::{self, Handle};
use crate::error::{BadPointer, Error, Result};
use crate::registry;

fn not_ours(p: usize) -> Error {
    let why = BadPointer::Refused("IPC export: not a block gpupool allocated on any device".into());
    Error::InvalidPointer { ptr: p, device: -1, why }
}

/// The descriptor of the live block at `p` (`share_granules`: as `Pool::ipc_export`).
pub fn export(p: usize, share_granules: bool) -> Result<Vec<u8>> {
    let handover = super::handover::export_tag();
    registry::with_owner_of(p, |pool| {
        let flags = if registry::is_tag_shard(pool.shard()) { FLAG_PAUSABLE } else { 0 };
        pool.ipc_export_via(p, share_granules, handover, flags)
    })
    .unwrap_or_else(|| Err(not_ours(p)))
}

/// The length `export` would return for the live block at `p`, exporting nothing.
pub fn export_len(p: usize) -> Result<usize> {
    registry::with_owner_of(p, |pool| pool.ipc_export_len(p)).unwrap_or_else(|| Err(not_ours(p)))
}

/// The live block at `p` in PyTorch's own handle format (`torch_format`), granules shared
/// as the framework routes share them.
pub fn export_torch(p: usize) -> Result<Handle> {
    let raw = export(p, true)?;
    Ok(torch_format::encode(&super::descriptor::AnyDescriptor::decode(&raw)?, &raw))
}
