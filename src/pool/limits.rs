//! The limit layer (`Limits`): who may reserve how much. It holds the device's `Budget`
//! (the reserved bytes of every shard and the limit on them, `budget.rs`) and this pool's
//! cache decay (`crate::decay`): every byte the pool asks the upstream for is claimed here
//! first, and decay says how much cached memory is worth keeping.
//!
//! It decides and books; giving memory back is the pool's (`release.rs`), which asks it
//! how much to give (`excess`, `decay_cap`, `on_malloc`).

use super::budget::Budget;
use super::options::PoolOptions;
use crate::config::LimitSpec;
use crate::decay::Decay;
use crate::error::{Error, Result};
use crate::upstream::Upstream;
use std::sync::Arc;

/// Refuse a limit of `bytes` above the device's `total` memory, as a share over 100 % is:
/// it would cap nothing and is more likely a unit slip than a wish. Managed memory
/// (`upstream` "managed") may exceed the device, so any limit stands there; 0 is no limit.
pub fn within_device(bytes: usize, total: usize, upstream: &str, what: &str) -> Result<()> {
    if bytes == 0 || bytes <= total || upstream == "managed" {
        return Ok(());
    }
    Err(Error::InvalidArgument(format!(
        "{what}: a limit of {bytes} bytes ({}) is more than the device's memory ({}); 0 means no limit",
        crate::error::human_bytes(bytes),
        crate::error::human_bytes(total)
    )))
}

/// The limit layer (module docs).
pub(super) struct Limits {
    /// The device's reserved bytes and their limit, shared with the device's other shards.
    budget: Arc<Budget>,
    decay: Option<Decay>,
}

impl Limits {
    /// The limit `opts` configures (a percentage of the device's memory asks `upstream`),
    /// set on the device's budget unless an earlier shard set it.
    pub fn new(opts: &PoolOptions, upstream: &mut dyn Upstream) -> Result<Limits> {
        let limit = match opts.limit {
            None => 0,
            Some(LimitSpec::Bytes(b)) => {
                within_device(b, upstream.mem_info()?.1, upstream.name(), "GPUPOOL_MEMORY_LIMIT")?;
                b
            }
            Some(spec @ LimitSpec::Percent(_)) => spec.resolve(upstream.mem_info()?.1),
        };
        let budget = opts.budget.clone().unwrap_or_default();
        budget.init_limit(limit);
        Ok(Limits { budget, decay: Decay::new(opts.decay_window) })
    }

    /// The device's budget (shared by its shards).
    pub fn budget(&self) -> &Arc<Budget> {
        &self.budget
    }

    pub fn limit(&self) -> usize {
        self.budget.limit()
    }

    pub fn set_limit(&self, bytes: usize) {
        self.budget.set_limit(bytes);
    }

    /// Reserved bytes of the device above its limit (0 without a limit or below it).
    pub fn excess(&self) -> usize {
        self.budget.excess()
    }

    /// Ask `up` for `bytes` of new memory with `get`, within the device's budget: `None`
    /// when the limit refuses (the upstream is not asked); a refusal by the upstream gives
    /// the claim back. On success the caller books the bytes (`confirm`).
    #[inline]
    pub fn within<T, E>(
        &self,
        bytes: usize,
        up: &mut dyn Upstream,
        get: impl FnOnce(&mut dyn Upstream) -> std::result::Result<T, E>,
    ) -> Option<std::result::Result<T, E>> {
        if !self.budget.claim(bytes) {
            return None;
        }
        let got = get(up);
        if got.is_err() {
            self.budget.unclaim(bytes);
        }
        Some(got)
    }

    /// A claim (`within`) whose memory arrived.
    #[inline]
    pub fn confirm(&self) {
        self.budget.confirm();
    }

    /// `bytes` went back to the upstream.
    #[inline]
    pub fn released(&self, bytes: usize) {
        self.budget.released(bytes);
    }

    /// About to reserve `grow` more bytes with `used` in use: the reserved bytes decay would
    /// keep beforehand, if decay is on.
    #[inline]
    pub fn decay_cap(&self, used: usize, grow: usize) -> Option<usize> {
        self.decay.as_ref().map(|d| d.cap(used + grow).saturating_sub(grow))
    }

    /// An allocation left `used()` bytes in use (asked only where decay is on): once per
    /// decay epoch, the reserved bytes worth keeping.
    #[inline]
    pub fn on_malloc(&mut self, used: impl FnOnce() -> usize) -> Option<usize> {
        self.decay.as_mut().and_then(|d| d.on_malloc(used()))
    }
}
