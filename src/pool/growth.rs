//! The terms of growth, which the escalation and each growth path (segment pools, the
//! arena; all in `grow.rs`) share: a request the cache could not serve,
//! the escalation's stages, what an attempt came to, and the part a growth path plays.

use super::Pool;
use crate::block::Block;
use crate::error::Result;
use crate::stream::{StreamHandle, StreamKey};

/// A request the cache could not serve: `size` bytes asked for, `rounded` by the strategy,
/// on `stream` (`key`).
#[derive(Clone, Copy)]
pub(super) struct Request {
    pub size: usize,
    pub rounded: usize,
    pub key: StreamKey,
    pub stream: StreamHandle,
}

/// The stages of the escalation (`Pool::escalate`): as is, after releasing some cached
/// memory, after releasing all of it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Stage {
    AsIs,
    ReleaseSome,
    ReleaseAll,
}

/// What one attempt to serve a request with new memory came to.
pub(super) enum Attempt {
    Served(Block),
    /// The upstream or the limit (`by_limit`) refused new memory.
    Refused { by_limit: bool },
    /// Nothing could be tried (the arena found no plan): the out-of-memory report keeps
    /// the cause an earlier stage found.
    Nothing,
}

/// A growth path's part in the escalation (`Pool::escalate`): how it serves a request once
/// with new memory, and how it gives cached memory back between stages. Segment pools
/// reserve segments (`SegmentGrowth`); the arena maps windows (`ArenaGrowth`); both in `grow.rs`.
pub(super) trait Grower {
    /// Serve `req` with new memory at `stage`.
    fn serve(&self, pool: &mut Pool, req: &Request, stage: Stage) -> Result<Attempt>;
    /// This path's steps at a later `stage` after the shared ones (thread caches flushed,
    /// CuPy's frees fenced, and the device waited for where that covers frees (`covered`)
    /// or the deferred frees finished), before memory is released: whether to try the
    /// cache now.
    fn before_release(&self, pool: &mut Pool, stage: Stage, covered: bool) -> bool;
    /// Release cached memory for `stage`; whether to try the cache again after it.
    fn release(&self, pool: &mut Pool, req: &Request, stage: Stage) -> Result<bool>;
}
