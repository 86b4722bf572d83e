//! Streams and events: stream identity, and the rule "is this cached block safe to hand
//! to stream S".
//!
//! The rule: a block freed on stream A may go
//! - to A at once (stream order protects it);
//! - to B only after an event recorded on A after the free has completed, or after B has
//!   been made to wait on that event (`cuStreamWaitEvent`).
//!
//! One event per stream, recorded **lazily**: a free only marks its stream stale, and the
//! event is recorded when another stream first wants one of its blocks (or a release must
//! wait for it). The record then covers every earlier free on that stream; recording later
//! than the free is conservative (it covers more work) and still correct. So a step that
//! reuses memory on its own stream makes no driver call at all, on any stream. Events are
//! created once per stream and recycled, never per call.
//!
//! Identity: the legacy default stream (handles 0 and `CU_STREAM_LEGACY`) is one key; a
//! user stream's key is its handle, as in PyTorch's allocator, which needs no driver call.
//! A handle can be recycled after `cuStreamDestroy`, but the driver releases a stream's
//! resources only once its queued work has completed, so a recycled handle never hides
//! pending work of the old stream. The per-thread default stream's handle names a different
//! stream on each thread: its key comes from `cuStreamGetId` and its frees are recorded at
//! once, on the thread that knows which stream it means.
//!
//! When a lazy record fails (the stream was destroyed), the blocks it would have covered
//! become safe after one device-wide synchronisation, unless a capture may be running
//! (`set_captures_possible`), in which case they simply stay on their stream.

use crate::error::Result;
use crate::upstream::{EventHandle, Upstream};

/// Set in the keys of per-thread default streams (driver ids), never in handles.
const PER_THREAD_KEY_BIT: u64 = 1 << 62;
use rustc_hash::FxHashMap;

// Stream identities (handles, keys, the legacy stream) belong to the driver layer; the
// tracker below and every layer above use them from there.
pub use crate::upstream::stream_id::{is_legacy, StreamHandle, StreamKey, STREAM_DEFAULT, STREAM_LEGACY, STREAM_PER_THREAD};

struct StreamState {
    /// A handle valid for recording on this stream (for the per-thread stream: only on the
    /// thread that freed, which is why it is recorded eagerly).
    handle: StreamHandle,
    event: Option<EventHandle>,
    /// True once `event` has a record that covers every free on this stream.
    recorded: bool,
    /// Frees happened since the last record (the next need records: lazy).
    stale: bool,
    /// Frees happened on this stream that no event covers: the stream was capturing a CUDA
    /// graph (an event recorded there belongs to the graph and cannot be queried), or the
    /// event could not be created or recorded. Its blocks are then not handed to other
    /// streams until a later free records successfully.
    uncovered: bool,
}

/// Per-pool stream bookkeeping: identities, one free-event per stream, a pool of spare
/// events for deferred frees (`record_stream`), and counters.
pub struct StreamTracker {
    states: FxHashMap<StreamKey, StreamState>,
    spare_events: Vec<EventHandle>,
    /// A legacy-stream free happened after the legacy event's last record.
    legacy_stale: bool,
    /// Test-only: treat every stream as the legacy stream (no synchronisation at all).
    ignore_streams: bool,
    /// A CUDA graph capture may be running (private pools route): no device-wide
    /// synchronisation, and no lazy record on a stream without asking whether it captures.
    captures_possible: bool,
    /// How many times a stream was made to wait on another's event.
    pub cross_stream_waits: u64,
    /// How many cached blocks moved across streams after their event had completed.
    pub cross_stream_ready: u64,
}

impl StreamTracker {
    pub fn new(ignore_streams: bool) -> Self {
        StreamTracker {
            states: FxHashMap::default(),
            spare_events: Vec::new(),
            legacy_stale: false,
            ignore_streams,
            captures_possible: false,
            cross_stream_waits: 0,
            cross_stream_ready: 0,
        }
    }

    pub fn ignores_streams(&self) -> bool {
        self.ignore_streams
    }

    /// See `captures_possible` (the pool sets it while private pools route allocations).
    pub fn set_captures_possible(&mut self, on: bool) {
        self.captures_possible = on;
    }

    /// Identity of `handle`: no driver call except for the per-thread default stream.
    pub fn key(&mut self, up: &mut dyn Upstream, handle: StreamHandle) -> Result<StreamKey> {
        if self.ignore_streams || is_legacy(handle) {
            return Ok(StreamKey::LEGACY);
        }
        if handle == STREAM_PER_THREAD {
            // Driver ids are small counters; the top bit keeps them apart from handles.
            return up.stream_key(handle).map(|k| StreamKey(k.0 | PER_THREAD_KEY_BIT));
        }
        Ok(StreamKey(handle as u64))
    }

    /// Called when a block is freed on `key`/`handle`: make the stream's event cover it.
    /// On failure the stream is marked uncovered (its blocks stay on it), never safe.
    pub fn on_free(&mut self, up: &mut dyn Upstream, key: StreamKey, handle: StreamHandle) -> Result<()> {
        if key == StreamKey::LEGACY {
            // Lazy: an earlier record no longer covers this free. (A flag, not a map
            // lookup: this is the hot path of PyTorch and CuPy.)
            self.legacy_stale = true;
            return Ok(());
        }
        if handle != STREAM_PER_THREAD {
            // Lazy as well: recorded when another stream (or a release) needs it.
            let st = self.states.entry(key).or_insert(StreamState {
                handle,
                event: None,
                recorded: false,
                stale: false,
                uncovered: false,
            });
            st.handle = handle;
            st.stale = true;
            return Ok(());
        }
        let st = self.state(up, key, handle);
        st.handle = handle;
        if st.event.is_none() {
            st.event = up.event_create().ok(); // creation failed before: try again
        }
        let Some(ev) = st.event else {
            st.uncovered = true;
            return Err(crate::error::Error::Internal("no event could be created for this stream".into()));
        };
        match up.event_record(ev, handle) {
            Ok(()) => {
                st.recorded = true;
                st.uncovered = false;
                Ok(())
            }
            Err(e) => {
                st.uncovered = true;
                Err(e)
            }
        }
    }

    /// A block was freed on `key` while that stream captures a CUDA graph: no event may be
    /// recorded there, so the stream's frees count as uncovered until its next free
    /// outside the capture.
    pub fn on_free_capturing(&mut self, up: &mut dyn Upstream, key: StreamKey, handle: StreamHandle) {
        if key == StreamKey::LEGACY {
            self.legacy_stale = true; // the legacy stream cannot capture; kept for safety
            return;
        }
        let st = self.state(up, key, handle);
        st.handle = handle;
        st.uncovered = true;
    }

    /// The state of a non-legacy stream, created with an event (None if creation failed:
    /// the stream is then uncovered).
    fn state(&mut self, up: &mut dyn Upstream, key: StreamKey, handle: StreamHandle) -> &mut StreamState {
        if !self.states.contains_key(&key) {
            let event = match self.spare_events.pop() {
                Some(e) => Some(e),
                None => up.event_create().ok(),
            };
            let uncovered = event.is_none();
            self.states.insert(key, StreamState { handle, event, recorded: false, stale: false, uncovered });
        }
        self.states.get_mut(&key).expect("inserted above")
    }

    /// The event covering every free on `from`, recording the legacy stream's lazily.
    fn covering_event(&mut self, up: &mut dyn Upstream, from: StreamKey) -> Result<Option<EventHandle>> {
        if from == StreamKey::LEGACY {
            let st = match self.states.get_mut(&from) {
                Some(s) => s,
                None => {
                    let ev = up.event_create()?;
                    self.states.entry(from).or_insert(StreamState { handle: STREAM_LEGACY, event: Some(ev), recorded: false, stale: false, uncovered: false })
                }
            };
            let ev = st.event.expect("legacy state has an event");
            if std::mem::take(&mut self.legacy_stale) {
                st.recorded = false;
            }
            if !st.recorded {
                up.event_record(ev, STREAM_LEGACY)?;
                st.recorded = true;
            }
            return Ok(Some(ev));
        }
        let captures_possible = self.captures_possible;
        let Some(st) = self.states.get_mut(&from) else { return Ok(None) };
        if st.uncovered && !st.stale {
            return Err(crate::error::Error::Internal("frees on this stream are not covered by an event".into()));
        }
        if st.stale {
            // (A free since the uncovered ones: a record now covers those too, the stream
            // no longer capturing.)
            // The lazy record. Never into a capture: it would belong to the graph.
            if captures_possible && up.capture_id(st.handle)?.is_some() {
                return Err(crate::error::Error::Internal("the stream is capturing; its frees are covered later".into()));
            }
            if st.event.is_none() {
                st.event = Some(match self.spare_events.pop() {
                    Some(e) => e,
                    None => up.event_create()?,
                });
            }
            let ev = st.event.expect("set above");
            up.event_record(ev, st.handle)?;
            st.recorded = true;
            st.stale = false;
            st.uncovered = false;
        }
        Ok(if st.recorded { st.event } else { None })
    }

    /// A lazy record failed (the stream is gone, or the driver refused): wait for the whole
    /// device once, after which nothing freed on `from` is pending. Not while a capture may
    /// run. Returns whether the blocks are now safe.
    fn cover_by_device_sync(&mut self, up: &mut dyn Upstream, from: StreamKey) -> bool {
        if self.captures_possible || up.synchronize_device().is_err() {
            return false;
        }
        if let Some(st) = self.states.get_mut(&from) {
            st.stale = false;
            st.recorded = false;
            st.uncovered = false;
        }
        true
    }

    /// Make blocks freed on `from` safe for use on stream `to`. Returns false when that is
    /// impossible (a driver call failed); the caller then must not reuse the block.
    pub fn make_safe(&mut self, up: &mut dyn Upstream, from: StreamKey, to: StreamKey, to_handle: StreamHandle) -> bool {
        if self.ignore_streams || from == to {
            return true;
        }
        let ev = match self.covering_event(up, from) {
            Ok(Some(ev)) => ev,
            // A stream that never freed through us has nothing to cover.
            Ok(None) => return true,
            Err(_) => return self.states.get(&from).is_some_and(|s| s.stale && !s.uncovered) && self.cover_by_device_sync(up, from),
        };
        match up.event_query(ev) {
            Ok(true) => {
                self.cross_stream_ready += 1;
                true
            }
            Ok(false) => {
                let h = if to == StreamKey::LEGACY { STREAM_LEGACY } else { to_handle };
                if up.stream_wait_event(h, ev).is_ok() {
                    self.cross_stream_waits += 1;
                    true
                } else {
                    false
                }
            }
            Err(_) => false,
        }
    }

    /// Record the legacy stream's event now if a legacy free happened since its last record.
    pub fn fence_legacy(&mut self, up: &mut dyn Upstream) -> Result<()> {
        if self.ignore_streams {
            return Ok(());
        }
        self.covering_event(up, StreamKey::LEGACY).map(|_| ())
    }

    /// Block the host until every free on `key` has completed on the device. Used before
    /// memory freed on that stream goes back to a non-stream-ordered upstream.
    pub fn synchronize(&mut self, up: &mut dyn Upstream, key: StreamKey) -> Result<()> {
        if self.ignore_streams {
            return Ok(());
        }
        if let Some(st) = self.states.get_mut(&key).filter(|s| s.uncovered) {
            // Cover the uncovered frees now with a record after them. Not while the stream
            // captures (the record would belong to the graph), and not through the per-thread
            // handle (on this thread it names another stream): then nothing is released.
            if st.handle == STREAM_PER_THREAD || up.capture_id(st.handle)?.is_some() {
                return Err(crate::error::Error::Internal("frees on this stream cannot be covered now".into()));
            }
            if st.event.is_none() {
                st.event = Some(up.event_create()?);
            }
            let ev = st.event.expect("set above");
            up.event_record(ev, st.handle)?;
            st.recorded = true;
            st.uncovered = false;
        }
        match self.covering_event(up, key) {
            Ok(Some(ev)) => up.event_synchronize(ev),
            Ok(None) => Ok(()),
            Err(e) => {
                if self.states.get(&key).is_some_and(|s| s.stale && !s.uncovered) && self.cover_by_device_sync(up, key) {
                    Ok(())
                } else {
                    Err(e)
                }
            }
        }
    }

    /// Block the host until every free on every stream has completed (a segment whose free
    /// blocks came from several streams is about to go back).
    pub fn synchronize_all(&mut self, up: &mut dyn Upstream) -> Result<()> {
        let keys: Vec<StreamKey> = self.states.keys().copied().collect();
        for k in keys {
            self.synchronize(up, k)?;
        }
        if self.legacy_stale {
            self.synchronize(up, StreamKey::LEGACY)?;
        }
        Ok(())
    }

    /// The handle to order an upstream release on, for a block last used on `key`.
    pub fn handle_of(&self, key: StreamKey) -> StreamHandle {
        if key == StreamKey::LEGACY {
            return STREAM_LEGACY;
        }
        self.states.get(&key).map(|s| s.handle).unwrap_or(STREAM_LEGACY)
    }

    /// An event from the spare pool, recorded on `handle` now (for `record_stream` frees).
    pub fn record_on(&mut self, up: &mut dyn Upstream, handle: StreamHandle) -> Result<EventHandle> {
        let ev = match self.spare_events.pop() {
            Some(e) => e,
            None => up.event_create()?,
        };
        if let Err(e) = up.event_record(ev, handle) {
            self.spare_events.push(ev);
            return Err(e);
        }
        Ok(ev)
    }

    /// Return an event to the spare pool.
    pub fn recycle(&mut self, ev: EventHandle) {
        self.spare_events.push(ev);
    }

    /// Destroy every event (pool teardown).
    pub fn destroy_all(&mut self, up: &mut dyn Upstream) {
        for (_, s) in self.states.drain() {
            if let Some(e) = s.event {
                up.event_destroy(e);
            }
        }
        for e in self.spare_events.drain(..) {
            up.event_destroy(e);
        }
    }
}
