//! A block another process sent, opened here for a framework (`Received`): the import, the
//! span it may be mapped through, the sender's hold this process releases when it lets go,
//! and a sender's count to give back. The framework's own tensor lifetime decides when it
//! closes (ffi hands it out as a DLPack tensor whose deleter calls `close`), so no Python
//! code runs at the close: it may come late in the interpreter's life, or on a thread
//! without the GIL.

use super::descriptor::AnyDescriptor;
use super::holds;
use super::spans::{open_shared, unshare, SendHold, SpanUse};
use crate::error::{Error, Result};
use crate::registry;

pub struct Received {
    /// Where the block starts in this process, and on which device.
    pub ptr: usize,
    pub device: i32,
    pub size: usize,
    /// On the host upstream: the memory is the CPU's.
    pub on_host: bool,
    hold: Option<SendHold>,
    /// The span it is mapped through, shared with other blocks in it (`open_shared`).
    span: Option<SpanUse>,
    /// A sender's count to give back once closed: a shared-memory object's name and the
    /// byte offset of the count in it (`give_back_count_at_close`).
    count: Option<(Vec<u8>, u64)>,
}

/// A close that failed, and how many of the sender's holds stay held because of it.
#[derive(Debug)]
pub struct CloseFailed {
    pub error: Error,
    pub holds_kept: usize,
}

impl Received {
    /// Map `d` on `device` through the descriptors `given` (which stay the caller's), with
    /// hold `slot` of the sender's holds file `holds_fd` (this process's copy, which stays
    /// the caller's; -1: no hold) to release at the close.
    pub fn open(d: &AnyDescriptor, device: i32, given: &[i32], holds_fd: i32, slot: u32) -> Result<Received> {
        // The holds file first: an import that cannot release its hold later must not be made.
        let hold = if holds_fd >= 0 { Some((holds::map_theirs(holds_fd)?, slot)) } else { None };
        let opened = (|| {
            let on_host = registry::with_pool(device, |pool| Ok(pool.upstream_name() == "host"))?;
            let size = usize::try_from(d.size())
                .ok()
                .filter(|&s| i64::try_from(s).is_ok())
                .ok_or_else(|| Error::InvalidArgument("IPC import: size out of range".into()))?;
            // Last: nothing after it may fail, or the import (or its share of a span) would stay.
            let (ptr, span) = open_shared(d, device, given, hold.is_some())?;
            Ok((on_host, size, ptr, span))
        })();
        match opened {
            Ok((on_host, size, ptr, span)) => Ok(Received { ptr, device, size, on_host, hold, span, count: None }),
            Err(e) => {
                // The hold stays the send's (its caller releases it): not one of this import's.
                if let Some((id, _)) = hold {
                    holds::forget(id);
                }
                Err(e)
            }
        }
    }

    /// Give the 64-bit count at `offset` in the POSIX shared-memory object `name` back (one
    /// down) once closed, as PyTorch's own CUDA IPC route counts its sends
    /// (`CudaIPCSentData`). Replaces any count given before.
    pub fn give_back_count_at_close(&mut self, name: Vec<u8>, offset: u64) {
        self.count = Some((name, offset));
    }

    /// Leave this import's own hold held at the close (the send may still be opened later,
    /// as it would have been had it not been opened ahead).
    pub fn keep_hold(&mut self) {
        if let Some((id, _)) = self.hold.take() {
            let _ = contained("keeping a hold", || {
                holds::forget(id);
                Ok(())
            });
        }
    }

    /// Close the import and release the holds it (and its span) kept, then give back the
    /// sender's count. A close that fails (the wait before the unmap) keeps every hold: the
    /// work this process queued on the block may still be running, and a released hold
    /// would let the sender reuse memory those kernels write. A fork child closes nothing.
    /// Each step is its own: a panic in one (an internal error) counts as that step's
    /// failure and the steps after it still run, as they would after an error, since this
    /// runs where no caller can be told (a tensor's deleter, the end of a batch).
    pub fn close(self) -> std::result::Result<(), CloseFailed> {
        if crate::process::in_child() {
            // No CUDA there, and another thread may have held the spans' lock at the fork.
            return Ok(());
        }
        let hold = self.hold;
        let unshared = match self.span {
            Some(key) => contained("letting go of a span", || Ok(unshare(key, hold))),
            None => Ok((Some(self.ptr), hold.into_iter().collect())),
        };
        // A span whose books could not be read keeps its holds and its mapping: nothing
        // known safe can be let go.
        let (close, holds) = unshared.map_err(|error| CloseFailed { error, holds_kept: usize::from(hold.is_some()) })?;
        if let Some(ptr) = close {
            if let Err(error) = contained("closing an import", || registry::with_pool(self.device, |pool| pool.importer().close(ptr))) {
                return Err(CloseFailed { error, holds_kept: holds.len() });
            }
        }
        for (id, slot) in holds {
            let _ = contained("releasing a hold", || holds::release(id, slot));
        }
        if let Some((name, offset)) = &self.count {
            if let Err(e) = contained("giving back a count", || holds::give_back_count(name, *offset)) {
                crate::error::warn(&format!(
                    "gpupool: warning: giving back the sender's count of the import at {:#x} failed: {e}",
                    self.ptr
                ));
            }
        }
        Ok(())
    }
}

/// `step`, with a panic in it turned into an internal error naming `what` and the panic's
/// message, which is also warned about: nobody may be there to read the error.
pub(super) fn contained<T>(what: &str, step: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(step)).unwrap_or_else(|payload| {
        let e = Error::Internal(format!("{what} panicked: {}", crate::error::panic_message(payload)));
        crate::error::warn(&format!("gpupool: warning: {e}"));
        Err(e)
    })
}
