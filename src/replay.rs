//! Replay of a `GPUPOOL_TRACE` file against a simulated device: the same allocation
//! sequence through any strategy, to compare peak reserved memory, fragmentation, OOMs and
//! time per operation on a user's real workload. `src/bin/gpupool-replay.rs` is the CLI.

use crate::config::PoolKind;
use crate::error::Error;
use crate::pool::{Pool, PoolOptions};
use crate::trace::{Action, HEADER};
use crate::upstream::sim::SimUpstream;
use crate::upstream::DriverCalls;
use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

/// One `alloc`, `free` or `reclaim` row of a trace: what the user did (the other rows are
/// the pool's consequences, not inputs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Op {
    pub device: i32,
    pub stream: usize,
    pub action: Action,
    pub ptr: usize,
    pub size: usize,
}

fn num(s: &str) -> Option<usize> {
    match s.strip_prefix("0x") {
        Some(h) => usize::from_str_radix(h, 16).ok(),
        None => s.parse().ok(),
    }
}

/// Parse a trace; errors name the line.
pub fn parse(text: &str) -> Result<Vec<Op>, String> {
    let mut ops = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line == HEADER {
            continue;
        }
        let f: Vec<&str> = line.split(',').collect();
        let bad = || format!("line {}: expected `{HEADER}`, got {line:?}", i + 1);
        if f.len() != 7 {
            return Err(bad());
        }
        let action = Action::parse(f[4]).ok_or_else(bad)?;
        let device: i32 = f[2].parse().map_err(|_| bad())?;
        let (stream, ptr, size) = (num(f[3]).ok_or_else(bad)?, num(f[5]).ok_or_else(bad)?, num(f[6]).ok_or_else(bad)?);
        match action {
            Action::Alloc | Action::Free | Action::Reclaim => ops.push(Op { device, stream, action, ptr, size }),
            _ => {}
        }
    }
    Ok(ops)
}

/// What a replay measured for one strategy.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub strategy: &'static str,
    pub allocs: u64,
    pub frees: u64,
    pub ooms: u64,
    /// Frees of pointers whose alloc is not in the trace (trace started late), skipped.
    pub unmatched_frees: u64,
    pub peak_reserved: usize,
    pub peak_used: usize,
    /// The peak of bytes requested by the trace's live allocations, each rounded up to
    /// 512 B as every pool rounds (what PyTorch's own allocator reports as allocated): the
    /// figure a pool's peak reserved is judged against, whatever the pool counts as used.
    pub peak_requested: usize,
    /// Reserved / used at the moment reserved peaked (1.0 = no overhead).
    pub reserved_over_used_at_peak: f64,
    pub ns_per_op: f64,
    pub upstream_allocs: u64,
    pub upstream_frees: u64,
    /// Page runs recommitted / decommitted inside segments.
    pub commits: u64,
    pub decommits: u64,
    /// Bytes of new segments and of recommitted pages (what the driver had to map).
    pub segment_bytes: u64,
    pub commit_bytes: u64,
    /// Reserved and requested-live bytes after the last event (what a benchmark that reads
    /// device memory at the end sees).
    pub end_reserved: usize,
    pub end_requested: usize,
    /// Driver calls over the whole replay, and over its second half (once a repeating
    /// program has settled, a pool that reuses what it holds makes none there).
    pub driver_calls: u64,
    pub driver_calls_second_half: u64,
    /// The second half's calls by kind (`mem_map N, set_access N`, or `none`): a stitch maps
    /// one alias per allocation, a growth creates too, so the kinds say which it was.
    pub second_half_by_kind: String,
    /// With `Steps`: each measured step's driver calls and whether the bytes in use reached
    /// a new peak during it (the steady state's figure excepts such steps).
    pub steps: Vec<StepCalls>,
}

/// Where a trace's steps lie, for a trace of a fixed number of events a step (the churn
/// workload's): after `first` events, one step every `every` events, the first `warmup`
/// of them not measured (as `bench/workloads/bench_workloads.py` counts them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Steps {
    pub first: usize,
    pub every: usize,
    pub warmup: usize,
}

impl Steps {
    /// `FIRST,EVERY,WARMUP`, e.g. `258,2000,5`.
    pub fn parse(s: &str) -> Option<Steps> {
        let v: Vec<usize> = s.split(',').map(|x| x.trim().parse().ok()).collect::<Option<_>>()?;
        match v[..] {
            [first, every, warmup] if every > 0 => Some(Steps { first, every, warmup }),
            _ => None,
        }
    }
}

/// One measured step of a replay with `Steps`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepCalls {
    pub calls: u64,
    pub new_peak: bool,
}

/// The second half of `steps` (as the benchmark splits them): mean calls a step, mean over
/// the steps that reached no new peak, the new-peak steps and the calls they made.
pub fn second_half_off_peak(steps: &[StepCalls]) -> (f64, f64, usize, u64) {
    let half = &steps[steps.len() / 2..];
    let mean = |v: &[u64]| if v.is_empty() { 0.0 } else { v.iter().sum::<u64>() as f64 / v.len() as f64 };
    let all: Vec<u64> = half.iter().map(|s| s.calls).collect();
    let off: Vec<u64> = half.iter().filter(|s| !s.new_peak).map(|s| s.calls).collect();
    let peaks = half.iter().filter(|s| s.new_peak);
    (mean(&all), mean(&off), peaks.clone().count(), peaks.map(|s| s.calls).sum())
}

/// Operations between two progress reports.
pub const PROGRESS_EVERY: usize = 1 << 16;

/// Replay `ops` through `kind` (default options) on a simulated `device`-like GPU of
/// `device_size` bytes per device.
pub fn replay(ops: &[Op], kind: PoolKind, device_size: usize) -> Result<Report, Error> {
    replay_with(ops, &PoolOptions { kind, ..Default::default() }, device_size, false)
}

/// Replay `ops` through pools built with `opts`; `paged`: simulate the `vmm` upstream
/// (pages inside segments can be given back) instead of `device`.
pub fn replay_with(ops: &[Op], opts: &PoolOptions, device_size: usize, paged: bool) -> Result<Report, Error> {
    replay_with_progress(ops, opts, device_size, paged, None, &mut |_, _| {})
}

/// `replay_with`, calling `progress(done, total)` every `PROGRESS_EVERY` operations and at
/// the end (the replay tool draws a progress line from it on a terminal); with `steps`,
/// the report lists each measured step's calls (`Report::steps`).
pub fn replay_with_progress(
    ops: &[Op],
    opts: &PoolOptions,
    device_size: usize,
    paged: bool,
    steps: Option<Steps>,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Report, Error> {
    let kind = opts.kind;
    let mut pools: BTreeMap<i32, Pool> = BTreeMap::new();
    let mut map: HashMap<(i32, usize), (usize, usize)> = HashMap::new();
    let mut r = Report::default();
    let mut busy = std::time::Duration::ZERO;
    let mut used_total = 0usize;
    let mut requested_total = 0usize;
    let mut reserved_total = 0usize;
    let mut used_at_peak = 0usize;
    let mut calls_at_half = None;
    let total_calls = |pools: &BTreeMap<i32, Pool>| pools.values().map(|p| p.driver_calls().total()).sum::<u64>();
    // The step under way: its index, the calls before it, whether it reached a new peak.
    let mut step: Option<(usize, u64, bool)> = None;
    for (i, op) in ops.iter().enumerate() {
        if i % PROGRESS_EVERY == 0 {
            progress(i, ops.len());
        }
        if let Some(st) = steps.filter(|st| i >= st.first && (i - st.first) % st.every == 0) {
            let now = total_calls(&pools);
            if let Some((k, before, new_peak)) = step.take() {
                if k >= st.warmup {
                    r.steps.push(StepCalls { calls: now - before, new_peak });
                }
            }
            // A trailing partial step (the teardown's frees) is not a step.
            if i + st.every <= ops.len() {
                step = Some(((i - st.first) / st.every, now, false));
            }
        }
        if i == ops.len() / 2 {
            calls_at_half = Some(pools.values().fold(DriverCalls::default(), |mut c, p| {
                c.add(&p.driver_calls());
                c
            }));
        }
        let pool = match pools.entry(op.device) {
            std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::btree_map::Entry::Vacant(e) => {
                e.insert(Pool::new(op.device, Box::new(SimUpstream::with_pages(device_size, paged)), opts)?)
            }
        };
        let before_reserved = pool.reserved_bytes();
        let before_used = pool.used_bytes();
        if op.action == Action::Reclaim {
            pool.reclaim()?;
        } else if op.action == Action::Alloc {
            let t = Instant::now();
            let res = pool.malloc(op.size, op.stream);
            busy += t.elapsed();
            match res {
                Ok(p) => {
                    r.allocs += 1;
                    if p != 0 {
                        let rounded = op.size.div_ceil(512) * 512;
                        map.insert((op.device, op.ptr), (p, rounded));
                        requested_total += rounded;
                        r.peak_requested = r.peak_requested.max(requested_total);
                    }
                }
                Err(Error::OutOfMemory(_)) => r.ooms += 1,
                Err(e) => return Err(e),
            }
        } else {
            match map.remove(&(op.device, op.ptr)) {
                Some((p, rounded)) => {
                    requested_total -= rounded;
                    let t = Instant::now();
                    pool.free(p, op.stream)?;
                    busy += t.elapsed();
                    r.frees += 1;
                }
                None => r.unmatched_frees += 1,
            }
        }
        reserved_total = reserved_total + pool.reserved_bytes() - before_reserved;
        used_total = used_total + pool.used_bytes() - before_used;
        if reserved_total > r.peak_reserved {
            r.peak_reserved = reserved_total;
            used_at_peak = used_total;
        }
        if used_total > r.peak_used {
            r.peak_used = used_total;
            if let Some(s) = step.as_mut() {
                s.2 = true;
            }
        }
    }
    if let (Some((k, before, new_peak)), Some(st)) = (step, steps) {
        if k >= st.warmup {
            r.steps.push(StepCalls { calls: total_calls(&pools) - before, new_peak });
        }
    }
    progress(ops.len(), ops.len());
    r.strategy = kind.name();
    r.reserved_over_used_at_peak = if used_at_peak == 0 { 0.0 } else { r.peak_reserved as f64 / used_at_peak as f64 };
    let n = r.allocs + r.frees;
    r.ns_per_op = if n == 0 { 0.0 } else { busy.as_nanos() as f64 / n as f64 };
    let mut calls_at_end = DriverCalls::default();
    for p in pools.values_mut() {
        calls_at_end.add(&p.driver_calls());
        let (sb, cb) = p.obtained_bytes();
        r.segment_bytes += sb;
        r.commit_bytes += cb;
        let (c, d) = p.page_ops();
        r.commits += c;
        r.decommits += d;
        let st = p.stats();
        r.upstream_allocs += st.n_upstream_allocs;
        r.upstream_frees += st.n_upstream_frees;
        r.end_reserved += st.total_bytes as usize;
        r.end_requested += st.requested_bytes as usize;
        r.driver_calls += p.driver_calls().total();
    }
    let at_half = calls_at_half.unwrap_or_default();
    r.driver_calls_second_half = r.driver_calls - at_half.total();
    let kinds: Vec<String> = calls_at_end.fields().iter().zip(at_half.fields()).filter(|(e, h)| e.1 > h.1).map(|(e, h)| format!("{} {}", e.0, e.1 - h.1)).collect();
    r.second_half_by_kind = if kinds.is_empty() { "none".into() } else { kinds.join(", ") };
    Ok(r)
}
