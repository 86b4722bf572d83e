//! The recording layer (`Recorder`): what the pool writes down about itself and changes
//! nothing by. Its counters (`Counters`, the figures of `Pool::stats`), the event trace
//! (`GPUPOOL_TRACE`, `crate::trace`), the leak records of live blocks (`GPUPOOL_DEBUG`,
//! `crate::debug`) and whether the books are checked after every operation (tests).
//!
//! The reports that read these figures together with the other layers' are `Pool` methods
//! (`reports.rs`, `snapshot.rs`).

use super::options::PoolOptions;
use crate::debug::AllocRecord;
use crate::stream::StreamHandle;
use crate::trace::{Action, Tracer};

/// The pool's running figures (`Pool::stats` reports them, less what thread caches keep).
#[derive(Default)]
pub(super) struct Counters {
    pub used: usize,
    pub requested: usize,
    pub reserved: usize,
    pub peak_used: usize,
    /// The peak of `requested`: the bytes callers asked for, before rounding.
    pub peak_requested: usize,
    pub peak_reserved: usize,
    pub allocs: u64,
    pub frees: u64,
    pub upstream_allocs: u64,
    pub upstream_frees: u64,
    pub ooms: u64,
    pub reclaims: u64,
    pub reclaimed_bytes: u64,
    pub invalid_frees: u64,
    pub deferred_frees: u64,
    /// Page runs recommitted / decommitted (page-mapped upstreams), and their bytes.
    pub commits: u64,
    pub decommits: u64,
    pub commit_bytes: u64,
    pub upstream_alloc_bytes: u64,
}

impl Counters {
    /// `bytes` arrived from the upstream (reserved; the peak may move).
    #[inline]
    pub fn add_reserved(&mut self, bytes: usize) {
        self.reserved += bytes;
        self.peak_reserved = self.peak_reserved.max(self.reserved);
    }
}

/// The recording layer (module docs).
pub(super) struct Recorder {
    pub c: Counters,
    tracer: Option<&'static Tracer>,
    /// `GPUPOOL_DEBUG` level: what each live block records (`AllocRecord::capture`).
    debug: u8,
    /// `PoolOptions::check_invariants`: scan the books after every operation.
    pub check: bool,
}

impl Recorder {
    pub fn new(opts: &PoolOptions) -> Recorder {
        Recorder { c: Counters::default(), tracer: opts.tracer, debug: opts.debug, check: opts.check_invariants }
    }

    /// Write an event of `device`'s pool to the trace, if one is on.
    #[inline]
    pub fn trace(&self, device: i32, stream: StreamHandle, action: Action, ptr: usize, size: usize) {
        if let Some(t) = self.tracer {
            t.record(device, stream, action, ptr, size);
        }
    }

    /// The leak record of a block allocated now on `stream` (`None` unless debugging).
    #[inline]
    pub fn alloc_record(&self, stream: StreamHandle) -> Option<Box<AllocRecord>> {
        AllocRecord::capture(self.debug, stream)
    }
}
