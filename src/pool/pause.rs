//! Pausing a pool: its device memory goes back to the driver while every address it
//! handed out stays reserved, and comes back at the same addresses on resume
//! (`docs/tags.md`). A tag's allocations are a pool of their own (`crate::registry`'s tag
//! shards), so pausing that pool pauses exactly the tag.
//!
//! While paused the pool hands out nothing (an allocation is refused, naming the tag),
//! refuses to export its blocks to other processes, and releases nothing (its memory is
//! given back already); a free is kept and done by the resume. Reports work and show the
//! paused bytes. The pool's books (blocks, granules, stitches) do not change across a
//! pause: the upstream swaps the physical memory under them (`VirtualMemory::vmm_pause`).

use super::{FreeOn, Pool};
use crate::error::{Error, Result};
use crate::stream::{StreamHandle, STREAM_LEGACY};
use crate::upstream::AllocError;
use crate::share::exports::BlockExports;

/// A paused pool's state.
pub(super) struct Paused {
    /// The name the caller paused it under (the tag), for messages.
    name: String,
    /// Device bytes released (and given back to the device's budget).
    bytes: usize,
    /// Frees made while paused, done by the resume.
    frees: rustc_hash::FxHashSet<usize>,
}

impl Pool {
    /// Pause this pool's memory (module docs): wait for the work on `stream` (a
    /// stream-ordered wait for the copies; the host waits for them and for earlier frees'
    /// events, never for the whole device unless a free's stream is gone), give cached free
    /// granules back, then copy what is mapped to host memory where `backup` asks and
    /// release it. Returns the device bytes released, cached ones included.
    pub(crate) fn pause(&mut self, name: &str, stream: StreamHandle, backup: bool) -> Result<usize> {
        self.ready_to_pause(&format!("pause `{name}`"))?;
        if !crate::stream::is_legacy(stream) && self.core.upstream_mut().capture_id(stream)?.is_some() {
            // Its wait for `stream` would be an event recorded into the graph.
            return Err(Error::Busy(format!(
                "pause `{name}`: stream {stream:#x} is capturing a CUDA graph; pause outside the capture"
            )));
        }
        // Blocks sent to other processes end their exports as their memory is released
        // (the upstream clears them first): a descriptor sent before the pause is refused
        // after it. A receiver that still maps the memory would keep the old allocation
        // alive (the device gets nothing back) and see it, not the resumed contents: gpupool
        // receivers count their open imports of a tag's memory (`protocol::FLAG_PAUSABLE`) in
        // this process's opens file, which the pause reads first, and drop the mappings they
        // keep idle when the front end's pause wakes them (`share::keepers`).
        self.exports.close_for_pause(name)?;
        let r = self.pause_closed(name, stream, backup);
        if self.paused.is_none() {
            // Nothing was released: imports of its exports may open again.
            self.exports.reopen();
        }
        r
    }

    /// The pause once no import of this pool's exports is open or may open.
    fn pause_closed(&mut self, name: &str, stream: StreamHandle, backup: bool) -> Result<usize> {
        let reserved_before = self.rec.c.reserved;
        self.flush_thread_caches(None);
        self.finish_pending(true);
        self.fence_unfenced();
        let allowed = self.device_sync_allowed();
        self.core.synchronize_all_streams(allowed)?;
        let _ = self.release_cached(None);
        let given_back = reserved_before - self.rec.c.reserved;
        let ev = self.core.record_on(stream)?;
        let r = self.core.upstream_mut().vmm_pause(Some(ev), backup);
        self.core.recycle_event(ev);
        let bytes = self.core.upstream().vmm_paused_bytes();
        if r.is_ok() || self.core.upstream().vmm_is_paused() {
            self.limits.budget().released(bytes);
            self.paused = Some(Paused { name: name.to_string(), bytes, frees: Default::default() });
        }
        r.map(|b| b + given_back)
    }

    /// This pool's exported blocks' exports (`crate::share::exports`): a pause closes them
    /// first, across a tag's devices (`registry::tags`).
    pub(crate) fn exports(&self) -> &BlockExports {
        &self.exports
    }

    /// Map this pool's memory again at the same addresses and restore its backup (module
    /// docs). A pool not paused: `Ok(0)`. Out of memory (the device's, or the pool limit):
    /// the memory stays paused, for a later resume.
    pub(crate) fn resume(&mut self) -> Result<usize> {
        self.running()?;
        let Some(p) = self.paused.as_ref() else { return Ok(0) };
        let (bytes, name) = (p.bytes, p.name.clone());
        let budget = self.limits.budget().clone();
        // Out of memory is the typed out-of-memory report (a caller may free memory and
        // resume again: the tag stays paused), for the tag's bytes.
        if !budget.claim(bytes) {
            return Err(self.oom(bytes, bytes, true));
        }
        match self.core.upstream_mut().vmm_resume() {
            Ok(_) => budget.confirm(),
            Err(e) => {
                budget.unclaim(bytes);
                return Err(match e {
                    AllocError::OutOfMemory => self.oom(bytes, bytes, false),
                    AllocError::Other(e) => Error::Internal(format!("resume `{name}`: {e}; it stays paused")),
                });
            }
        }
        let p = self.paused.take().expect("checked above");
        // Exports the pause did not end (a pause that failed midway) may be opened again.
        self.exports.reopen();
        // Their memory is back and no queued work uses it (the pause waited, the resume's
        // copies finished): freed on the legacy stream, which every stream may follow.
        for ptr in p.frees {
            let _ = self.free(ptr, FreeOn::Stream(STREAM_LEGACY));
        }
        // Private pools released while paused (a graph destroyed during the sleep) go now.
        self.settle_after_captures();
        Ok(bytes)
    }

    /// Whether this pool is paused.
    pub(crate) fn is_paused(&self) -> bool {
        self.paused.is_some()
    }

    /// The tag this pool is paused under and how many of its blocks were freed meanwhile
    /// (their frees are done by the resume); `None`: not paused.
    pub(crate) fn paused_frees(&self) -> Option<(&str, usize)> {
        self.paused.as_ref().map(|p| (p.name.as_str(), p.frees.len()))
    }

    /// Device bytes this pool's pause released (0: not paused).
    pub(crate) fn paused_bytes(&self) -> usize {
        self.paused.as_ref().map_or(0, |p| p.bytes)
    }

    /// Make the host memory the next pause's backup copies into now, as large as this
    /// pool's memory (`VirtualMemory::vmm_prepare_backup`); returns its bytes.
    pub(crate) fn prepare_pause_backup(&mut self) -> Result<usize> {
        self.ready_to_pause("prepare_backup")?;
        self.core.upstream_mut().vmm_prepare_backup()
    }

    /// Refused (`what` names the call) where this pool stopped, is paused, or cannot pause.
    fn ready_to_pause(&self, what: &str) -> Result<()> {
        self.running()?;
        self.not_paused()?;
        if !self.core.is_arena() {
            return Err(Error::InvalidArgument(format!(
                "{what}: device {}'s pool is `{}`; pausing needs the `arena` strategy, which maps memory with the virtual memory API",
                self.core.device(),
                self.core.strategy().name()
            )));
        }
        if self.graphs.has_routes() {
            // Its pause would release memory a capture in progress is being given.
            return Err(Error::Busy(format!(
                "{what}: a CUDA graph capture or MemPool scope begun under the tag routes allocations into it on \
                 device {}; end it (leave the `torch.cuda.graph` / `use_mem_pool` block) first",
                self.core.device()
            )));
        }
        Ok(())
    }

    /// Let device `peer` access this pool's memory from now on, what is mapped now included
    /// (Note [Peer access on demand]); returns the grants made.
    /// (A stopped pool grants too: granting what is mapped changes none of its books.)
    pub(crate) fn enable_peer(&mut self, peer: i32) -> Result<usize> {
        self.core.upstream_mut().vmm_enable_peer(peer)
    }

    /// Give back the host memory kept for the next pause's backup; returns its bytes.
    pub(crate) fn drop_pause_backup(&mut self) -> usize {
        self.core.upstream_mut().vmm_drop_backup()
    }

    /// Refuse work that needs the memory mapped, naming the paused tag.
    pub(super) fn not_paused(&self) -> Result<()> {
        match &self.paused {
            None => Ok(()),
            Some(p) => Err(Error::InvalidArgument(format!(
                "memory tagged `{}` on device {} is paused; resume it first",
                p.name, self.core.device()
            ))),
        }
    }

    /// A free while paused: checked against the live blocks now, done by the resume.
    pub(super) fn free_while_paused(&mut self, ptr: usize) -> Result<()> {
        if ptr == 0 {
            return Ok(());
        }
        let already = self.paused.as_ref().is_some_and(|p| p.frees.contains(&ptr));
        if already || !self.core.is_live(ptr) {
            self.rec.c.invalid_frees += 1;
            return Err(if already {
                Error::InvalidPointer { ptr, device: self.core.device(), why: crate::error::BadPointer::AlreadyFreed }
            } else {
                self.classify_bad_pointer(ptr)
            });
        }
        if let Some(p) = self.paused.as_mut() {
            p.frees.insert(ptr);
        }
        Ok(())
    }
}
