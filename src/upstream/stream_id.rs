//! Stream identities as the driver gives them: the raw handle a caller passes, the key the
//! pool books blocks under (a user stream's handle; the per-thread default stream's
//! `cuStreamGetId`, see `StreamTracker::key`), and the special handles of the
//! default streams. The lowest layer owns them because the driver defines them; the
//! strategies, the pool and the front end use them from here.

/// A raw `CUstream` / `cudaStream_t` value as the caller passed it.
pub type StreamHandle = usize;

/// `0`: the legacy default stream.
pub const STREAM_DEFAULT: StreamHandle = 0;
/// `CU_STREAM_LEGACY`: the legacy default stream, named explicitly.
pub const STREAM_LEGACY: StreamHandle = 0x1;
/// `CU_STREAM_PER_THREAD`: the calling thread's per-thread default stream.
pub const STREAM_PER_THREAD: StreamHandle = 0x2;

/// A stream's identity for the pool: the legacy stream, a user stream's handle, or the
/// per-thread default stream's driver id (`StreamTracker::key` says why that is safe).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamKey(pub u64);

impl StreamKey {
    /// The legacy default stream (handles 0 and `CU_STREAM_LEGACY`).
    pub const LEGACY: StreamKey = StreamKey(u64::MAX);
    /// A segment whose free blocks were last used on different streams (`drain_free_segments`):
    /// releasing it waits for every stream.
    pub const MIXED: StreamKey = StreamKey(u64::MAX - 1);
}

/// Whether a handle names the legacy default stream.
pub fn is_legacy(h: StreamHandle) -> bool {
    h == STREAM_DEFAULT || h == STREAM_LEGACY
}
