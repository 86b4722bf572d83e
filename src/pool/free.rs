//! Frees: the one entry point (`Pool::free`, told by `FreeOn` what is known of the freeing
//! stream) and the steps behind it; deferred frees (`record_stream`) and fences; the
//! live-pointer checks that turn a bad pointer into a clear error.

use super::{WordState, Live, Pool, NO_OWNER};
use crate::block::Block;
use crate::error::{BadPointer, Error, Result};
use crate::stream::{StreamHandle, StreamKey};
use crate::trace::Action;

/// What a free knows about the stream its block was last used on: the argument of
/// `Pool::free`. A bare stream handle converts to `FreeOn::Stream`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FreeOn {
    /// The caller names the stream, alive now (the C API, PyTorch): the free records there.
    /// Freeing null (0) does nothing.
    Stream(StreamHandle),
    /// The stream the block was allocated for (CuPy, which names no stream at free; CuPy's
    /// own pool reuses a block only on its allocation stream, so that stream's order is the
    /// one its users rely on). That stream may have been destroyed since: the free records
    /// there only when it is `current`, the caller's current stream (alive now), and
    /// otherwise touches no handle. Whether the stream captures a graph is asked even while
    /// no private pool routes (CuPy captures nobody announced).
    AsAllocated { current: Option<StreamHandle> },
    /// No stream at all (CuPy without its stream getter): the block is reused only after
    /// the next fence on the legacy stream. Freeing null (0) does nothing.
    Unordered,
}

impl From<StreamHandle> for FreeOn {
    fn from(stream: StreamHandle) -> FreeOn {
        FreeOn::Stream(stream)
    }
}

impl Pool {
    /// Free `ptr`, last used on the stream `on` says what is known of (a stream handle:
    /// that stream, alive now).
    #[inline]
    pub fn free(&mut self, ptr: usize, on: impl Into<FreeOn>) -> Result<()> {
        if self.paused.is_some() {
            return self.free_while_paused(ptr);
        }
        match on.into() {
            FreeOn::Stream(stream) => {
                if ptr == 0 {
                    return Ok(());
                }
                self.free_on_stream(ptr, stream)
            }
            FreeOn::AsAllocated { current } => self.free_as_allocated(ptr, current),
            FreeOn::Unordered => self.free_unordered(ptr),
        }
    }

    /// `FreeOn::AsAllocated`.
    fn free_as_allocated(&mut self, ptr: usize, current: Option<StreamHandle>) -> Result<()> {
        self.running()?;
        let Some((handle, key)) = self.core.live(ptr).map(|l| (l.handle, l.block.stream)) else {
            self.rec.c.invalid_frees += 1;
            return Err(self.classify_bad_pointer(ptr));
        };
        // The key booked at allocation. Its handle's stream may have been destroyed since
        // (the driver must then not be asked about it): only when it is the caller's current
        // stream is it known alive, and the free records there.
        self.free_later(ptr, handle, key, true, current)
    }

    /// A free made later than the block's last use on its stream (`handle`/`key`, booked at
    /// allocation), by CuPy or out of a thread cache: it records on the stream when
    /// `handle` is `alive` (the stream of the operation in progress, or the legacy stream,
    /// never destroyed), and otherwise records nothing and touches no handle.
    pub(super) fn free_later(&mut self, ptr: usize, handle: StreamHandle, key: StreamKey, check_capture: bool, alive: Option<StreamHandle>) -> Result<()> {
        if key == StreamKey::LEGACY || alive == Some(handle) {
            return self.free_keyed(ptr, handle, key, check_capture);
        }
        let live = self.take_live(ptr, handle)?;
        self.free_live(live, None, key, false)
    }

    /// `FreeOn::Stream` for a non-null `ptr`.
    fn free_on_stream(&mut self, ptr: usize, stream: StreamHandle) -> Result<()> {
        self.running()?;
        // Resolve the stream first, so a failure there changes nothing.
        let key = self.core.key(stream)?;
        self.free_keyed(ptr, stream, key, false)
    }

    /// The free of `ptr` on `stream`, whose key is `key`.
    fn free_keyed(&mut self, ptr: usize, stream: StreamHandle, key: StreamKey, check_capture: bool) -> Result<()> {
        let live = self.take_live(ptr, stream)?;
        self.free_live(live, Some(stream), key, check_capture)
    }

    /// The rest of a free once `live` is out of the live map (one map operation per free).
    /// `stream`: the freeing stream's handle, alive now; None when no live handle is known
    /// (`free_later`): then nothing is recorded and the stream is left uncovered.
    fn free_live(&mut self, live: Live, stream: Option<StreamHandle>, key: StreamKey, check_capture: bool) -> Result<()> {
        if let Some(id) = live.private {
            let block = Block { stream: key, ..live.block };
            // Used on other streams too (`record_stream`): no event may be asked about
            // while the graph may capture, so the block is kept out of reuse until its
            // private pool goes (PyTorch defers such frees past the capture).
            let r = if live.extra_streams.is_empty() { self.free_private(block, id) } else { self.quarantine_private(block, id) };
            self.verify();
            return r;
        }
        let mut block = Block { stream: key, ..live.block };
        let Some(stream) = stream else {
            self.core.on_free_unrecorded(key, block.size);
            return self.finish_free(live, block, check_capture, None);
        };
        let capturing = self.capturing(stream, check_capture);
        if capturing {
            // An event recorded on a capturing stream belongs to the graph: record none, and
            // keep the stream's blocks on it until a later free covers them.
            self.core.on_free_capturing(key, stream);
        } else if self.core.on_free(key, stream, &block).is_err() && self.wait_for_device().is_ok() {
            // No event covers this free (the driver refused the record or the event): after
            // a wait for the whole device the block is safe anywhere.
            block.stream = StreamKey::LEGACY;
        }
        self.finish_free(live, block, check_capture, Some(stream))
    }

    /// The end of a free, once the freeing stream's event is dealt with: the streams the
    /// block was also used on (`record_stream`), then the cache.
    /// `alive`: the freeing stream's handle when the caller named it (valid now).
    fn finish_free(&mut self, live: Live, block: Block, check_capture: bool, alive: Option<StreamHandle>) -> Result<()> {
        // (The extra streams' handles were named by `record_stream` and must still be alive,
        // as with PyTorch's own allocator, which records on them at the free too.)
        if !self.core.streams().ignores_streams() && live.extra_streams.iter().any(|&h| self.capturing(h, check_capture)) {
            // An extra stream is capturing: an event recorded there would belong to the graph
            // and could never be waited for. Hold the free until no route is active.
            self.rec.c.deferred_frees += 1;
            self.defer_past_capture(block, live.extra_streams);
            self.verify();
            return Ok(());
        }
        let mut events = Vec::new();
        if !self.core.streams().ignores_streams() {
            for &h in &live.extra_streams {
                match self.core.record_on(h) {
                    Ok(ev) => events.push(ev),
                    // No event can say when that stream's work is done: wait for the
                    // device now rather than hand the block out early.
                    Err(_) => {
                        if let Err(e) = self.wait_for_device() {
                            for ev in events {
                                self.core.recycle_event(ev);
                            }
                            self.restore_live(live);
                            return Err(e);
                        }
                    }
                }
            }
        }
        let result = if events.is_empty() {
            self.put_block(block, alive)
        } else {
            self.rec.c.deferred_frees += 1;
            self.core.defer(block, events);
            Ok(())
        };
        self.verify();
        result
    }

    /// `alive`: a handle of the stream that freed `block`, valid now (None: none is known).
    pub(super) fn put_block(&mut self, block: Block, alive: Option<StreamHandle>) -> Result<()> {
        if !self.exports.is_empty() {
            // Before the memory can serve another block: a descriptor of this one must no
            // longer map it.
            self.exports.end_block(block.addr);
        }
        match self.core.strategy_mut().put(block) {
            // Not cached (`none`): straight back. A stream-ordered upstream orders the
            // release on the freeing stream; any other first waits for that stream's work
            // (cuMemFree happens to synchronise by itself, cuMemUnmap does not).
            Some(seg) => {
                // A stream-ordered upstream queues the release on the freeing stream while
                // its handle is known alive; otherwise (a stored handle may be dead by now)
                // the stream is waited for and the release goes on the legacy stream.
                let r = match alive {
                    Some(h) if self.core.upstream().stream_ordered() && !self.core.streams().is_uncovered(seg.stream) => {
                        let h = if seg.stream == StreamKey::LEGACY { crate::stream::STREAM_LEGACY } else { h };
                        self.give_to_upstream(seg, h)
                    }
                    _ => self.release_segment(seg),
                };
                // A refused release keeps the segment (reserved, unusable) for a later retry:
                // the free itself succeeded.
                if r.is_err() {
                    self.core.keep_unreleased(seg);
                }
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// Move deferred frees whose events completed (all of them, waiting, if `wait`).
    pub(super) fn finish_pending(&mut self, wait: bool) {
        let mut at = 0;
        while let Some(block) = self.core.next_passed(wait, &mut at) {
            let _ = self.put_block(block, None);
        }
    }

    pub(super) fn classify_bad_pointer(&self, ptr: usize) -> Error {
        let why = if self.core.holds_freed(ptr)
            || self.graphs.is_free_block(ptr)
            || self.core.live(ptr).is_some_and(|l| l.owner != NO_OWNER && self.caches.is_kept(l.owner, ptr))
        {
            BadPointer::AlreadyFreed
        } else if let Some(b) = self.core.live_around(ptr) {
            BadPointer::Interior { block_start: b.addr, block_size: b.size }
        } else {
            BadPointer::Unknown
        };
        Error::InvalidPointer { ptr, device: self.core.device(), why }
    }

    /// Remove `ptr` from the live map for a free on `stream` (counted and traced); an
    /// unknown pointer is counted as an invalid free and changes nothing else.
    pub(super) fn take_live(&mut self, ptr: usize, stream: StreamHandle) -> Result<Live> {
        let Some(live) = self.core.remove_live(ptr) else {
            self.rec.c.invalid_frees += 1;
            return Err(self.classify_bad_pointer(ptr));
        };
        if live.owner != NO_OWNER && self.caches.claim(live.owner, ptr).is_some_and(|h| h != WordState::Handed) {
            // Its thread freed it already and keeps it for reuse: a double free.
            self.core.insert_live(live);
            self.rec.c.invalid_frees += 1;
            return Err(Error::InvalidPointer { ptr, device: self.core.device(), why: BadPointer::AlreadyFreed });
        }
        self.trace(stream, Action::Free, ptr, live.requested);
        self.rec.c.used -= live.block.size;
        self.rec.c.requested -= live.requested;
        self.rec.c.frees += 1;
        Ok(live)
    }

    /// Undo `take_live` for a free that could not finish (nothing about the block changed).
    pub(super) fn restore_live(&mut self, live: Live) {
        self.rec.c.used += live.block.size;
        self.rec.c.requested += live.requested;
        self.rec.c.frees -= 1;
        self.core.insert_live(live);
    }

    /// The free of `ptr` will also wait for work queued on `stream` until the free.
    pub fn record_stream(&mut self, ptr: usize, stream: StreamHandle) -> Result<()> {
        self.running()?;
        let Some(l) = self.core.live_mut(ptr) else {
            return Err(self.classify_bad_pointer(ptr));
        };
        // Its free must now reach the pool (which waits for `stream`): off the fast path.
        if l.owner != NO_OWNER && self.caches.claim(l.owner, ptr).is_some_and(|h| h != WordState::Handed) {
            return Err(Error::InvalidPointer { ptr, device: self.core.device(), why: BadPointer::AlreadyFreed });
        }
        if !l.extra_streams.contains(&stream) {
            l.extra_streams.push(stream);
        }
        Ok(())
    }

    /// `FreeOn::Unordered`. The block becomes reusable after the next fence (an event
    /// record) on the legacy default stream: work issued later on any blocking stream waits
    /// for legacy-stream work, which waited for all earlier work on blocking streams. Fences
    /// are batched: up to `UNFENCED_MAX_BLOCKS` blocks / `UNFENCED_MAX_BYTES` wait for one;
    /// meanwhile requests are served from fenced cache or new memory, never from unfenced
    /// blocks. Pressure (limit, OOM, reclaim) fences at once.
    fn free_unordered(&mut self, ptr: usize) -> Result<()> {
        self.running()?;
        if self.core.streams().ignores_streams() {
            return self.free(ptr, FreeOn::Stream(crate::stream::STREAM_LEGACY));
        }
        if ptr == 0 {
            return Ok(());
        }
        let live = self.take_live(ptr, crate::stream::STREAM_LEGACY)?;
        // Private blocks and blocks used on other streams take the full free (their pool,
        // their events); a stream-less free cannot do less for them.
        if live.private.is_some() || !live.extra_streams.is_empty() {
            // (A stream-less free comes later than the block's last use: its booked stream
            // is not named to the driver, as in `free_later`.)
            let key = live.block.stream;
            return self.free_live(live, None, key, false);
        }
        self.core.push_unfenced(Block { stream: StreamKey::LEGACY, ..live.block });
        if self.core.unfenced_full() {
            self.fence_unfenced();
        }
        self.verify();
        Ok(())
    }

    /// Fence the legacy stream and hand every unfenced block to the strategy. Where the
    /// fence fails they stay unfenced (never reused unsafely), for the next fence.
    pub(super) fn fence_unfenced(&mut self) {
        if !self.core.has_unfenced() || !self.fence_legacy_now() {
            return;
        }
        for b in self.core.take_unfenced() {
            let _ = self.put_block(b, None);
        }
    }
}

/// Blocks coming back from the threads' fast-path caches (`crate::thread_cache`), under the
/// device lock.
impl Pool {
    /// Give every block kept in a thread cache back to the pool (reclaim, limits, growth,
    /// reconfiguration). `current`: the stream of the operation in progress, if any (its
    /// kept blocks record their free there; the others' streams may be gone).
    pub(crate) fn flush_thread_caches(&mut self, current: Option<StreamHandle>) {
        let mut kept = self.caches.reap();
        kept.extend(self.caches.take_all_kept(false));
        for (p, state) in kept {
            self.release_kept(p, state, current);
        }
    }

    /// Free a block taken out of a thread cache: its user freed it already (counted then).
    /// A CuPy free not yet fenced joins the pool's unfenced frees. `current`: the stream of
    /// the operation in progress (alive now), if any.
    pub(crate) fn release_kept(&mut self, ptr: usize, state: WordState, current: Option<StreamHandle>) {
        let counted = self.rec.c.frees;
        let _ = match state {
            WordState::Unfenced => self.free(ptr, FreeOn::Unordered),
            // Kept only when freed on its allocation stream: free it there, recording only
            // if that stream is known alive (its user may have destroyed it since the free).
            _ => match self.core.live(ptr).map(|l| (l.handle, l.block.stream)) {
                Some((h, key)) => self.free_later(ptr, h, key, false, current),
                None => self.free(ptr, FreeOn::Stream(crate::stream::STREAM_LEGACY)),
            },
        };
        self.rec.c.frees = counted;
    }
}
