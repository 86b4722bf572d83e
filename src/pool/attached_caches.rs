//! The pool's side of the per-thread fast path (`crate::thread_cache`): the operations on
//! its attached caches (`crate::thread_cache::state::AttachedCaches`) that need the pool's
//! books: attaching a thread, taking kept blocks back, and the figures reports subtract.
//! Everything here runs under the device lock.

use super::{FreeOn, Pool, PoolOptions};
use crate::config::PoolKind;
use crate::stream::StreamHandle;
use crate::thread_cache::state::{WordState, ThreadCache};
use std::sync::Arc;

/// Whether a pool built with `opts` for `device` attaches thread caches: where `opts` asks
/// for them and nothing needs every operation to reach the pool (debug records, a trace,
/// `none`), never in the unsafe test mode (whose point is a pool that reuses at once, the
/// way the cache never does), and never for a caller's upstream (no device).
pub(super) fn thread_caches_wanted(opts: &PoolOptions, device: i32) -> bool {
    opts.thread_cache
        && opts.debug == 0
        && opts.tracer.is_none()
        && opts.kind != PoolKind::None
        && !opts.unsafe_ignore_streams
        && device >= 0
}

/// The pool's operations on its thread caches, under the device lock.
impl Pool {
    /// The calling thread's fast-path cache for a locked allocation on `stream`: `current`
    /// is the (pool id, cache id) the thread already has for this device. Exited threads'
    /// caches are emptied first. Returns the cache id to pass to `malloc_owned` (with
    /// `owner_of`), and a new cache for the thread to install, if one was made. `None`: no
    /// fast path here (disabled, or the per-thread default stream).
    pub(crate) fn attach_thread(&mut self, current: Option<(u64, u32)>, stream: StreamHandle) -> Option<(u32, Option<Arc<ThreadCache>>)> {
        if !self.caches.enabled() || stream == crate::stream::STREAM_PER_THREAD {
            return None; // (the per-thread default stream means another stream on each thread)
        }
        if self.caches.has_orphans() {
            for (p, state) in self.caches.reap() {
                self.release_kept(p, state, Some(stream));
            }
        }
        self.caches.attach(current)
    }

    /// Thread caches registered with this pool (exited threads' until the next locked
    /// operation reaps them), and the blocks their users freed that they keep.
    pub fn thread_caches(&self) -> (usize, usize) {
        (self.caches.count(), self.caches.kept().len())
    }

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

    /// Count, bytes and requested bytes of the blocks kept (freed) in thread caches.
    pub(super) fn kept_bytes(&self) -> (usize, usize, usize) {
        let kept = self.caches.kept();
        let n = kept.len();
        kept.iter().filter_map(|&p| self.core.live(p)).fold((n, 0, 0), |a, l| (a.0, a.1 + l.block.size, a.2 + l.requested))
    }
}
