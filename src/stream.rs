//! Streams and events: stream identity, and the rule "is this cached block safe to hand
//! to stream S".
//!
//! The rule: a block freed on stream A may go
//! - to A at once (stream order protects it);
//! - to B only after an event recorded on A after the free has completed, or after B has
//!   been made to wait on that event (`cuStreamWaitEvent`).
//!
//! One event per stream is re-recorded (RMM's scheme): the latest record covers every
//! earlier free, so a single wait makes all of A's frees safe for B. Events are created once
//! per stream and recycled, never per call.
//!
//! A record costs a driver call, more than the rest of a cached
//! allocation, and a free that A itself reuses needs none (stream order protects it). So
//! user streams record in batches: a free is *pending* (its range is remembered) until the
//! stream's next record, made at one of its frees once `batch` frees or `batch_bytes`
//! bytes are pending, or at once when another stream was refused a pending block since the
//! last record (`wanted`). A pending block serves its own stream at once and no other until
//! then; anything that must know a pending free done (a release, decay or decommit, a
//! stitch's eviction) waits for the whole device instead, and is refused while a capture
//! may run. Those happen under pressure, on reclaim, with decay switched on, or when the
//! stitch cache is full. The batch is bounded (`EVENT_BATCH`, `EVENT_BATCH_BYTES`; a
//! stream whose batches fill with no other stream asking for its blocks doubles its own, up
//! to 16x the frees and 4x the bytes, and the first refusal resets it), so at most that much
//! memory per stream waits for another stream's benefit. (`split` asks a
//! few more of a stream's free blocks when its best fit is pending; `binned` passes over a
//! stream after one refusal, and the arena's windows and stitches span whole runs: `wanted`
//! makes that stream's next free record, so that lasts until then.) Strategies that give memory back at each
//! free (`none`) record every free: their release must wait for exactly that free.
//!
//! The legacy default stream (handle 0 / `CU_STREAM_LEGACY`) is the hot path of PyTorch
//! and CuPy; it is never destroyed and its handle is valid from any thread, so its event
//! is recorded lazily — only when another stream wants one of its blocks. Recording later
//! than the free is conservative (it covers more work) and still correct. User streams and
//! the per-thread default stream are recorded at free time, because a user stream may be
//! destroyed later and the per-thread handle names another stream on another thread.
//!
//! A stored user-stream handle is never used for a driver call: the stream may have been
//! destroyed since, and the driver does not check (recording an event on a destroyed stream
//! crashes inside `cuEventRecord`). A free that happens later than its stream's last known
//! use (a block a thread cache kept, CuPy's free of an array whose stream is gone) records
//! nothing: `on_free_unrecorded` leaves the stream *uncovered*, so its blocks serve only that
//! stream until one of its own frees records again, or until a device-wide synchronisation
//! (`device_synchronized`) covers everything. The pool makes that synchronisation only where
//! it would otherwise grow, and never while a capture may run (`Pool::cover_by_device_sync`).
//!
//! One stream's books (its event, pending frees, batch) are `state.rs`; the tracker here
//! applies the rule to them.

use crate::error::Result;
use crate::upstream::{EventHandle, Upstream};

/// Set in the keys of per-thread default streams (driver ids), never in handles.
const PER_THREAD_KEY_BIT: u64 = 1 << 62;
use rustc_hash::FxHashMap;
use state::{StreamState, MAX_BATCH_BYTES_DOUBLINGS, MAX_BATCH_DOUBLINGS};

mod state;

// Stream identities (handles, keys, the legacy stream) belong to the driver layer; the
// tracker below and every layer above use them from there.
pub use crate::upstream::stream_id::{is_legacy, StreamHandle, StreamKey, STREAM_DEFAULT, STREAM_LEGACY, STREAM_PER_THREAD};

/// User-stream frees between two event records, at most (module docs; the configuration
/// layer owns the default, `GPUPOOL_EVENT_BATCH` overrides it).
pub use crate::config::EVENT_BATCH;
/// ...and bytes pending, at most (`GPUPOOL_EVENT_BATCH_BYTES` overrides it).
pub use crate::config::EVENT_BATCH_BYTES;

/// Per-pool stream bookkeeping: identities, one free-event per stream, a pool of spare
/// events for deferred frees (`record_stream`), and counters.
pub struct StreamTracker {
    states: FxHashMap<StreamKey, StreamState>,
    spare_events: Vec<EventHandle>,
    /// A legacy-stream free happened after the legacy event's last record.
    legacy_stale: bool,
    /// Test-only: treat every stream as the legacy stream (no synchronisation at all).
    ignore_streams: bool,
    /// Bytes freed with no record since the last device-wide wait (`on_free_unrecorded`):
    /// how much memory may be waiting for one.
    unrecorded_bytes: usize,
    /// Frees (and bytes) a user stream may leave pending before it records (1: every free
    /// records).
    batch: usize,
    batch_bytes: usize,
    /// How many times a stream was made to wait on another's event.
    pub cross_stream_waits: u64,
    /// How many cached blocks moved across streams after their event had completed.
    pub cross_stream_ready: u64,
}

impl StreamTracker {
    /// `batch`, `batch_bytes`: user-stream frees and bytes per event record (batch 1: a
    /// record at every free; see the module docs).
    pub fn new(ignore_streams: bool, batch: usize, batch_bytes: usize) -> Self {
        StreamTracker {
            states: FxHashMap::default(),
            spare_events: Vec::new(),
            legacy_stale: false,
            ignore_streams,
            unrecorded_bytes: 0,
            batch: batch.max(1),
            batch_bytes: if batch > 1 { batch_bytes } else { 0 },
            cross_stream_waits: 0,
            cross_stream_ready: 0,
        }
    }

    pub fn ignores_streams(&self) -> bool {
        self.ignore_streams
    }

    /// Identity of `handle`, with no driver call except for the per-thread default stream.
    /// A user stream's key is its handle, as in PyTorch's allocator: a handle can be
    /// recycled after `cuStreamDestroy`, but the driver releases a stream's resources only
    /// once its queued work has completed, so a recycled handle hides no pending work.
    /// The per-thread default stream's handle names a different stream on each thread: its
    /// key comes from `cuStreamGetId`.
    pub fn key(&mut self, up: &mut dyn Upstream, handle: StreamHandle) -> Result<StreamKey> {
        if self.ignore_streams || is_legacy(handle) {
            return Ok(StreamKey::LEGACY);
        }
        if handle == STREAM_PER_THREAD {
            // Driver ids are small counters; the bit keeps them apart from handles.
            return up.stream_key(handle).map(|k| StreamKey(k.0 | PER_THREAD_KEY_BIT));
        }
        Ok(StreamKey(handle as u64))
    }

    /// Called when a block is freed on `key`/`handle` (alive now): make the stream's event
    /// cover it, now or at a later free of the same stream (`ranges`: the block, as
    /// `Strategy::home_ranges` names it, kept as pending until then). On failure the stream
    /// is marked uncovered (its blocks stay on it), never safe.
    pub fn on_free(&mut self, up: &mut dyn Upstream, key: StreamKey, handle: StreamHandle, ranges: &[(usize, usize)]) -> Result<()> {
        if key == StreamKey::LEGACY {
            // Lazy: an earlier record no longer covers this free. (A flag, not a map
            // lookup: this is the hot path of PyTorch and CuPy.)
            self.legacy_stale = true;
            return Ok(());
        }
        if handle == STREAM_PER_THREAD && up.stream_key(handle).ok().map(|k| StreamKey(k.0 | PER_THREAD_KEY_BIT)) != Some(key) {
            // Freed from another thread than the one whose per-thread stream used it: a record
            // here would go on this thread's stream. Leave the stream uncovered; its own
            // thread's next free covers it.
            let st = self.state(up, key, handle);
            st.uncovered = true;
            return Ok(());
        }
        let (batch, batch_bytes) = (self.batch, self.batch_bytes);
        let st = self.state(up, key, handle);
        st.handle = handle;
        let bytes: usize = ranges.iter().map(|r| r.1).sum();
        let frees_cap = batch.saturating_mul(1 << st.doublings);
        let bytes_cap = batch_bytes.saturating_mul(1 << st.doublings.min(MAX_BATCH_BYTES_DOUBLINGS));
        if !st.wanted && !st.uncovered && st.event.is_some() && st.pending_frees + 1 < frees_cap && st.pending_bytes + bytes < bytes_cap {
            st.pending.extend_from_slice(ranges);
            for &(a, l) in ranges {
                st.pending_lo = st.pending_lo.min(a);
                st.pending_hi = st.pending_hi.max(a + l);
            }
            st.pending_frees += 1;
            st.pending_bytes += bytes;
            return Ok(());
        }
        // A batch that filled with nobody asking grows (one another stream asked for, or an
        // uncovered stream's recovery, starts over in `record`).
        if batch > 1 && !st.wanted && !st.uncovered && st.pending_frees > 0 {
            st.doublings = (st.doublings + 1).min(MAX_BATCH_DOUBLINGS);
        }
        Self::record(up, st, handle)
    }

    /// Record `key`'s event on `handle` (alive now) so that it covers every free so far.
    /// For memory that must be covered at once (a new segment of a stream-ordered upstream).
    pub fn record_now(&mut self, up: &mut dyn Upstream, key: StreamKey, handle: StreamHandle) -> Result<()> {
        if key == StreamKey::LEGACY || self.ignore_streams {
            self.legacy_stale |= key == StreamKey::LEGACY;
            return Ok(());
        }
        let st = self.state(up, key, handle);
        st.handle = handle;
        Self::record(up, st, handle)
    }

    fn record(up: &mut dyn Upstream, st: &mut StreamState, handle: StreamHandle) -> Result<()> {
        // Whatever makes this record (a free, or a growth's `record_now`), a stream another
        // one asked of starts its batch over: the asker must not wait a long batch again.
        if st.wanted || st.uncovered {
            st.doublings = 0;
        }
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
                st.complete = false;
                st.uncovered = false;
                st.wanted = false;
                st.clear_pending();
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

    /// A block was freed on `key` without a handle known to be alive (its stream may have
    /// been destroyed since): record nothing and touch no handle; the stream's blocks stay
    /// on it until a later recorded free or a device-wide synchronisation covers them.
    pub fn on_free_unrecorded(&mut self, up: &mut dyn Upstream, key: StreamKey, bytes: usize) {
        if key == StreamKey::LEGACY {
            self.legacy_stale = true; // never destroyed: recorded lazily as always
            return;
        }
        // (A new state's handle is only a placeholder: uncovered streams are covered by a
        // device-wide synchronisation, never through their stored handle.)
        self.state(up, key, STREAM_LEGACY).uncovered = true;
        self.unrecorded_bytes += bytes;
    }

    /// Bytes freed with no record since the last device-wide wait.
    pub fn unrecorded_bytes(&self) -> usize {
        self.unrecorded_bytes
    }

    /// Some stream has frees no event covers (uncovered, or pending a batched record).
    pub fn has_uncovered(&self) -> bool {
        self.states.values().any(|s| s.uncovered || !s.pending.is_empty())
    }

    /// Must every free on `key` be waited for with a device-wide wait? True when some are
    /// covered by no event: the stream is uncovered, or frees wait for its next batched
    /// record (its stored handle may be dead by now, so no record can be made for them).
    pub fn is_uncovered(&self, key: StreamKey) -> bool {
        key != StreamKey::LEGACY && self.states.get(&key).is_some_and(|s| s.uncovered || !s.pending.is_empty())
    }

    /// The whole device was synchronised: every free so far has completed, so no stream's
    /// blocks need an event any more.
    pub fn device_synchronized(&mut self) {
        for s in self.states.values_mut() {
            s.uncovered = false;
            s.recorded = false; // nothing left to cover (`covering_event` answers None)
            s.complete = false;
            s.clear_pending();
            s.wanted = false;
            s.doublings = 0;
        }
        self.legacy_stale = false;
        self.unrecorded_bytes = 0;
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
            self.states.insert(key, StreamState::new(handle, event, uncovered));
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
                    self.states.entry(from).or_insert(StreamState::new(STREAM_LEGACY, Some(ev), false))
                }
            };
            let ev = st.event.expect("legacy state has an event");
            if std::mem::take(&mut self.legacy_stale) {
                st.recorded = false;
            }
            if !st.recorded {
                up.event_record(ev, STREAM_LEGACY)?;
                st.recorded = true;
                st.complete = false;
            }
            return Ok(Some(ev));
        }
        match self.states.get(&from) {
            Some(s) if s.uncovered => Err(crate::error::Error::Internal("frees on this stream are not covered by an event".into())),
            Some(s) if s.recorded => Ok(s.event),
            _ => Ok(None),
        }
    }

    /// The reuse gate a strategy asks while it serves a request on `to` (`to_handle`):
    /// `make_safe` for each piece of free memory it would hand over. The strategy calls it
    /// without knowing of streams or the upstream.
    pub fn reuse_gate<'a>(&'a mut self, up: &'a mut dyn Upstream, to: StreamKey, to_handle: StreamHandle) -> impl FnMut(StreamKey, usize, usize) -> bool + 'a {
        move |from, addr, len| self.make_safe(up, from, to, to_handle, addr, len)
    }

    /// The release gate a strategy asks before it gives back free memory last used on a
    /// stream: every stream where `device_wait` (a device-wide wait may prove it idle), else
    /// only streams whose frees events cover.
    pub fn release_gate(&self, device_wait: bool) -> impl FnMut(StreamKey) -> bool + '_ {
        move |key| device_wait || !self.is_uncovered(key)
    }

    /// Make free memory `[addr, addr + len)` last used on `from` safe for use on stream
    /// `to`. Returns false when that is impossible now (a free there waits for `from`'s next
    /// batched record, or a driver call failed); the caller then must not reuse it.
    pub fn make_safe(&mut self, up: &mut dyn Upstream, from: StreamKey, to: StreamKey, to_handle: StreamHandle, addr: usize, len: usize) -> bool {
        if self.ignore_streams || from == to {
            return true;
        }
        if from == StreamKey::MIXED {
            // Only a drained segment carries this tag, and it is released, never handed
            // out; should one reach a cache, no single event covers it.
            return false;
        }
        if let Some(st) = self.states.get_mut(&from) {
            let in_span = st.pending_lo < addr + len && addr < st.pending_hi;
            if in_span && st.pending.iter().any(|&(a, l)| a < addr + len && addr < a + l) {
                // Covered by no record yet: `from`'s next free records (its handle is alive
                // only then), and this memory is everyone's from that moment on.
                st.wanted = true;
                return false;
            }
        }
        let ev = match self.covering_event(up, from) {
            Ok(Some(ev)) => ev,
            // A stream that never freed through us has nothing to cover.
            Ok(None) => return true,
            Err(_) => return false,
        };
        if self.states.get(&from).is_some_and(|s| s.complete) {
            self.cross_stream_ready += 1;
            return true;
        }
        match up.event_query(ev) {
            Ok(true) => {
                if let Some(st) = self.states.get_mut(&from) {
                    st.complete = true;
                }
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
    /// `device_sync_allowed`: an uncovered stream may be waited for with a device-wide
    /// synchronisation (the caller knows no announced capture runs, which it would break);
    /// otherwise its memory cannot be proven idle and the call fails, releasing nothing.
    pub fn synchronize(&mut self, up: &mut dyn Upstream, key: StreamKey, device_sync_allowed: bool) -> Result<()> {
        if self.ignore_streams {
            return Ok(());
        }
        if self.is_uncovered(key) {
            // Its stored handle may name a destroyed stream: wait for the whole device.
            if !device_sync_allowed {
                return Err(crate::error::Error::Internal("frees on this stream cannot be covered now".into()));
            }
            up.synchronize_device()?;
            self.device_synchronized();
            return Ok(());
        }
        if let Some(ev) = self.covering_event(up, key)? {
            up.event_synchronize(ev)?;
        }
        Ok(())
    }

    /// Block the host until every free on every stream has completed (a segment whose free
    /// blocks came from several streams is about to go back).
    pub fn synchronize_all(&mut self, up: &mut dyn Upstream, device_sync_allowed: bool) -> Result<()> {
        let keys: Vec<StreamKey> = self.states.keys().copied().collect();
        for k in keys {
            self.synchronize(up, k, device_sync_allowed)?;
        }
        if self.legacy_stale {
            self.synchronize(up, StreamKey::LEGACY, device_sync_allowed)?;
        }
        Ok(())
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
