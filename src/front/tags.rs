//! Tags (`docs/tags.md`): this thread's current tag, what a tag's memory is made of, and a
//! tag's pause and resume on a device.

use crate::error::{Error, Result};
use crate::registry;
use crate::tags::TagMemory;

/// This thread allocates under `name` until `end` (tags nest).
pub fn begin(name: &str) -> Result<()> {
    crate::tags::begin(name)
}

/// This thread's innermost tag ends.
pub fn end() -> Result<()> {
    crate::tags::end()
}

/// Make tag `name`'s memory `memory` (`TagMemory::ACCEPTED` names the choices).
pub fn place(name: &str, memory: &str) -> Result<()> {
    let kind = TagMemory::parse(memory).ok_or_else(|| {
        Error::InvalidArgument(format!("tag {name:?}: memory {memory:?} is not one gpupool makes; accepted: {}", TagMemory::ACCEPTED))
    })?;
    registry::place_tag(name, kind)
}

/// Every tag named so far, one line each: the name, a tab, what its memory is made of.
pub fn names() -> String {
    crate::tags::all().into_iter().map(|(n, m)| format!("{n}\t{}\n", m.name())).collect()
}

/// Pause tag `name` on `device` after the work queued on `stream`; the bytes released.
pub fn pause(device: i32, name: &str, stream: usize, backup: bool) -> Result<usize> {
    let releases = crate::share::keepers::releases();
    let paused = registry::pause_tag(device, name, stream, backup);
    // Receivers that keep idle mappings of the memory it released drop them now: the device
    // gets the memory back before the pause returns (also where the pause failed after
    // releasing some).
    crate::share::keepers::let_go_since(releases);
    paused
}

/// Resume tag `name` on `device`; the bytes restored.
pub fn resume(device: i32, name: &str) -> Result<usize> {
    registry::resume_tag(device, name)
}

/// The bytes tag `name` holds paused on `device`.
pub fn paused_bytes(device: i32, name: &str) -> Result<usize> {
    registry::tag_paused_bytes(device, name)
}

/// Give tag `name`'s backup buffer on `device` back; its bytes.
pub fn drop_backup(device: i32, name: &str) -> Result<usize> {
    registry::tag_backup_drop(device, name)
}

/// Page-lock tag `name`'s backup buffer on `device` ahead of its first pause; its bytes.
pub fn prepare_backup(device: i32, name: &str) -> Result<usize> {
    registry::tag_backup_prepare(device, name)
}
