//! One stream's books in the tracker (`StreamTracker`, `stream.rs`): its handle and event,
//! whether the event covers its frees, the ranges freed since its last record, and how far
//! its batch has grown.

use super::StreamHandle;
use crate::upstream::EventHandle;

/// One stream's books (module docs).
pub(super) struct StreamState {
    /// The handle of this stream's last free that named one (for the per-thread stream:
    /// valid only on the thread that freed, which is why it is recorded eagerly). Never used
    /// for a driver call after that free returned: the stream may have been destroyed since.
    pub(super) handle: StreamHandle,
    pub(super) event: Option<EventHandle>,
    /// True once `event` has a record that covers every free on this stream.
    pub(super) recorded: bool,
    /// `event`'s latest record was seen complete (`make_safe`): until the next record, the
    /// frees it covers are safe for any stream with no further query. Why: once a stream
    /// stops freeing (it was destroyed, or moved on), its cached blocks are offered to the
    /// shard's other streams again and again, and each offer asked the driver.
    pub(super) complete: bool,
    /// Frees happened on this stream that no event covers: the stream was capturing a CUDA
    /// graph (an event recorded there belongs to the graph and cannot be queried), the
    /// event could not be created or recorded, or the free came later than the stream's
    /// last known use (`on_free_unrecorded`). Its blocks are then not handed to other
    /// streams until a later free records successfully or the whole device is waited for
    /// (`device_synchronized`).
    pub(super) uncovered: bool,
    /// Ranges freed since the event's last record (in the strategy's gating addresses,
    /// `Strategy::home_ranges`), and their bytes: they serve this stream only.
    pub(super) pending: Vec<(usize, usize)>,
    /// Frees and bytes those ranges hold (a stitch's free names several ranges).
    pub(super) pending_frees: usize,
    pub(super) pending_bytes: usize,
    /// The span `[pending_lo, pending_hi)` holding every pending range: a block outside it
    /// is not pending, with no walk over the list (which grows with the batch).
    pub(super) pending_lo: usize,
    pub(super) pending_hi: usize,
    /// Another stream was refused a pending block: the next free records at once.
    pub(super) wanted: bool,
    /// How often this stream's batch has doubled (`on_free`): each full batch that no
    /// other stream asked for doubles it, up to `MAX_BATCH_DOUBLINGS`; a refusal resets it.
    pub(super) doublings: u32,
}

/// A stream whose batches fill with no other stream asking for its blocks records ever less
/// often: its batch doubles per such record, up to 16x the configured frees (4,096 by
/// default) and 4x the bytes (1 GiB). Why: records are what make threads on different
/// streams wait for each other inside the driver (`crate::config::EVENT_BATCH`), and a
/// stream nobody borrows from gains nothing from them. What a longer batch costs is only
/// how long other streams wait for its blocks, and the first refusal ends that: the
/// stream's next free records and its batch starts over.
pub(super) const MAX_BATCH_DOUBLINGS: u32 = 4;
pub(super) const MAX_BATCH_BYTES_DOUBLINGS: u32 = 2;

impl StreamState {
    pub(super) fn new(handle: StreamHandle, event: Option<EventHandle>, uncovered: bool) -> StreamState {
        StreamState {
            handle,
            event,
            recorded: false,
            complete: false,
            uncovered,
            pending: Vec::new(),
            pending_frees: 0,
            pending_bytes: 0,
            pending_lo: usize::MAX,
            pending_hi: 0,
            wanted: false,
            doublings: 0,
        }
    }

    pub(super) fn clear_pending(&mut self) {
        self.pending.clear();
        (self.pending_frees, self.pending_bytes, self.pending_lo, self.pending_hi) = (0, 0, usize::MAX, 0);
    }
}
