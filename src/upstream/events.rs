//! The stream concern of an upstream: stream identities, events and their waits, graph
//! capture, device synchronisation. The methods map 1:1 to the CUDA driver's; upstreams
//! without streams (host) keep the defaults, in which every event is complete at once and
//! no stream ever captures.

use super::stream_id::{StreamHandle, StreamKey};
use super::EventHandle;
use crate::error::Result;

/// Streams and events (module docs).
pub trait Events: Send {
    /// Identity of a non-legacy stream handle.
    fn stream_key(&mut self, handle: StreamHandle) -> Result<StreamKey> {
        Ok(StreamKey(handle as u64))
    }

    fn event_create(&mut self) -> Result<EventHandle> {
        Ok(0)
    }
    fn event_destroy(&mut self, _ev: EventHandle) {}
    fn event_record(&mut self, _ev: EventHandle, _stream: StreamHandle) -> Result<()> {
        Ok(())
    }
    /// True when all work captured by the event's last record has completed.
    fn event_query(&mut self, _ev: EventHandle) -> Result<bool> {
        Ok(true)
    }
    fn event_synchronize(&mut self, _ev: EventHandle) -> Result<()> {
        Ok(())
    }
    fn stream_wait_event(&mut self, _stream: StreamHandle, _ev: EventHandle) -> Result<()> {
        Ok(())
    }

    /// The id of the CUDA graph capture `stream` takes part in, or `None` when it is not
    /// capturing (`cuStreamGetCaptureInfo`). Upstreams without streams never capture.
    fn capture_id(&mut self, _stream: StreamHandle) -> Result<Option<u64>> {
        Ok(None)
    }
    /// While `on`, make every driver call in relaxed stream-capture mode
    /// (`cuThreadExchangeStreamCaptureMode`), so that a graph captured in global mode on any
    /// thread is not invalidated by the pool's own calls (PyTorch does the same around its
    /// `cudaMalloc`). The pool turns it on while private pools route allocations.
    fn set_capture_relaxed(&mut self, _on: bool) {}
    /// Wait until every stream of the device is idle. Used once when a private (graph) pool
    /// is destroyed: a graph may have been launched on any stream, so no one event covers
    /// its work.
    fn synchronize_device(&mut self) -> Result<()> {
        Ok(())
    }
}
