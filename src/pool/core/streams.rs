//! `Core`'s stream operations: the stream tracker's calls, each made with the upstream it
//! records and waits through, so no layer above holds both at once.

use super::Core;
use crate::block::Block;
use crate::error::Result;
use crate::stream::{StreamHandle, StreamKey, StreamTracker};
use crate::upstream::EventHandle;

/// The stream tracker's operations, each with the upstream it records and waits through.
impl Core {
    /// The stream tracker, for what it knows (uncovered streams, counts).
    #[inline]
    pub fn streams(&self) -> &StreamTracker {
        &self.streams
    }

    /// Record `stream`'s (`key`) event now, covering its frees so far.
    #[inline]
    pub fn record_now(&mut self, key: StreamKey, stream: StreamHandle) -> Result<()> {
        self.streams.record_now(&mut *self.upstream, key, stream)
    }

    /// An event recorded on `stream` now (for a free's `record_stream` streams or a pause).
    #[inline]
    pub fn record_on(&mut self, stream: StreamHandle) -> Result<EventHandle> {
        self.streams.record_on(&mut *self.upstream, stream)
    }

    /// Give back an event from `record_on` once it is no longer waited for.
    #[inline]
    pub fn recycle_event(&mut self, ev: EventHandle) {
        self.streams.recycle(ev);
    }

    /// Wait until the work `key`'s frees were made behind is done (`device_wait`: whether
    /// an uncovered stream may be waited for by a device-wide wait).
    #[inline]
    pub fn synchronize_stream(&mut self, key: StreamKey, device_wait: bool) -> Result<()> {
        self.streams.synchronize(&mut *self.upstream, key, device_wait)
    }

    /// `synchronize_stream` for every stream the tracker knows.
    #[inline]
    pub fn synchronize_all_streams(&mut self, device_wait: bool) -> Result<()> {
        self.streams.synchronize_all(&mut *self.upstream, device_wait)
    }

    /// Wait for the whole device; every stream's frees are then covered.
    pub fn synchronize_device(&mut self) -> Result<()> {
        self.upstream.synchronize_device()?;
        self.streams.device_synchronized();
        Ok(())
    }

    /// Destroy the tracker's events (the pool is going).
    pub fn destroy_streams(&mut self) {
        self.streams.destroy_all(&mut *self.upstream);
    }

    /// Book a free on `key` for which no live handle is known: nothing is recorded and the
    /// stream is left uncovered.
    #[inline]
    pub fn on_free_unrecorded(&mut self, key: StreamKey, bytes: usize) {
        self.streams.on_free_unrecorded(&mut *self.upstream, key, bytes);
    }

    /// Book a free on a capturing `stream`: no event may be recorded there.
    #[inline]
    pub fn on_free_capturing(&mut self, key: StreamKey, stream: StreamHandle) {
        self.streams.on_free_capturing(&mut *self.upstream, key, stream);
    }

    /// Book `block`'s free on `stream` (`key`), with the home ranges the strategy says it
    /// leaves pending there (an arena stitch's homes). Err: no event covers it.
    pub fn on_free(&mut self, key: StreamKey, stream: StreamHandle, block: &Block) -> Result<()> {
        let ranges = &mut self.scratch_ranges;
        ranges.clear();
        if key != StreamKey::LEGACY {
            self.strategy.home_ranges(block, ranges);
        }
        self.streams.on_free(&mut *self.upstream, key, stream, ranges)
    }
}
