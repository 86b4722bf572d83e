//! A device's reports, added up over its shards: statistics, the status text, its JSON and
//! the memory snapshot. A device with one shard in use reports exactly what that pool
//! says; with several, the counters are sums and the device-wide figures come from the
//! shared budget (reserved peak, limit).
//!
//! One figure cannot be exact across shards without a shared counter on the hot path:
//! the peak of bytes in use. Each shard knows its own peak; the device's is reported as
//! the sum of the shards' peaks, an upper bound that is exact when one shard served
//! (every allocation on the legacy stream or stream-less, or `GPUPOOL_STREAM_SHARDS=0`).
//! The status report says so when it applies.

use super::{for_each_shard, with_pool, Result};
use crate::error::human_bytes;
use crate::stats::{render_json, render_status, Stats};
use crate::pool::ArenaFigures;
use crate::upstream::DriverCalls;

/// What one shard contributes to the device's reports.
struct Part {
    shard: u16,
    stats: Stats,
    calls: DriverCalls,
    arena: Option<ArenaFigures>,
    strategy: &'static str,
    /// Why this shard runs another strategy than configured (an arena without address space).
    notice: Option<String>,
    /// The tag whose pool this is (`tags.rs`), and the bytes its pause gave back.
    tag: Option<String>,
    paused: usize,
}

/// The device's own figures where it has more than one shard in use: the budget's peak of
/// reserved bytes and its limit.
type DeviceWide = Option<(usize, usize)>;

/// Shard 0's report of `device` (made if needed: asking for a report makes the pool, as
/// before shards) and the other shards' parts.
fn parts<R>(device: i32, first: impl FnOnce(&mut crate::pool::Pool) -> R) -> Result<(R, Vec<Part>, DeviceWide)> {
    let (r, budget) = with_pool(device, |p| Ok((first(p), p.budget().clone())))?;
    let mut parts = Vec::new();
    for_each_shard(device, |p| parts.push(Part {
            shard: p.shard(),
            stats: p.stats(),
            calls: p.driver_calls(),
            arena: p.arena_figures(),
            strategy: p.strategy_name(),
            notice: p.notice().map(str::to_owned),
            tag: super::tags::tag_of_shard(p.shard() as usize),
            paused: p.paused_bytes(),
        }))?;
    let device_wide = (parts.len() > 1).then(|| (budget.peak(), budget.limit()));
    Ok((r, parts, device_wide))
}

/// The sum of the shards' statistics.
fn total(parts: &[Part], device_wide: DeviceWide) -> Stats {
    let mut t = parts[0].stats;
    for p in &parts[1..] {
        let s = &p.stats;
        t.used_bytes += s.used_bytes;
        t.free_bytes += s.free_bytes;
        t.total_bytes += s.total_bytes;
        t.n_free_blocks += s.n_free_blocks;
        t.n_live_blocks += s.n_live_blocks;
        t.requested_bytes += s.requested_bytes;
        t.peak_used_bytes += s.peak_used_bytes;
        t.peak_requested_bytes += s.peak_requested_bytes;
        t.n_allocs += s.n_allocs;
        t.n_frees += s.n_frees;
        t.n_upstream_allocs += s.n_upstream_allocs;
        t.n_upstream_frees += s.n_upstream_frees;
        t.n_ooms += s.n_ooms;
        // A reclaim reaches every shard: shard 0's count is the device's.
        t.reclaimed_bytes += s.reclaimed_bytes;
        t.n_invalid_frees += s.n_invalid_frees;
        t.largest_free_block = t.largest_free_block.max(s.largest_free_block);
        t.n_cross_stream_reuses += s.n_cross_stream_reuses;
        t.n_deferred_frees += s.n_deferred_frees;
    }
    if let Some((peak, limit)) = device_wide {
        t.peak_total_bytes = peak as u64;
        t.limit_bytes = limit as u64;
    }
    t
}

/// The shards' arenas added up (`None`: no shard is an arena).
fn arena(parts: &[Part]) -> Option<ArenaFigures> {
    parts.iter().filter_map(|p| p.arena.clone()).reduce(|mut a, b| {
        a.add(&b);
        a
    })
}

/// Notices of stream shards (shard 0's are in its own extras): a shard whose arena could not
/// reserve its address space runs `split`, and the device's report must say so.
fn shard_notices(parts: &[Part]) -> Vec<String> {
    parts.iter().filter(|p| p.shard != 0).filter_map(|p| p.notice.as_ref().map(|n| format!("shard {}: {n}", p.shard))).collect()
}

fn calls(parts: &[Part]) -> DriverCalls {
    let mut c = DriverCalls::default();
    for p in parts {
        c.add(&p.calls);
    }
    c
}

/// `device`'s statistics (`gpupool_get_stats`).
pub fn stats(device: i32) -> Result<Stats> {
    let ((), parts, wide) = parts(device, |_| ())?;
    Ok(total(&parts, wide))
}

/// Start `device`'s peaks again from what each shard holds now, and the device-wide peak of
/// reserved bytes (what a sharded device reports) from what it reserves now.
pub fn reset_peaks(device: i32) -> Result<()> {
    let budget = with_pool(device, |p| Ok(p.budget().clone()))?;
    budget.reset_peak();
    super::for_each_shard(device, |p| p.reset_peaks())
}

/// `device`'s status report.
pub fn memory_status(device: i32) -> Result<String> {
    let ((own, extras, ctx), parts, wide) = parts(device, |p| (p.memory_status(), p.status_extras(None), p.report_context()))?;
    if wide.is_none() {
        return Ok(own);
    }
    let mut out = render_status(&ctx, &total(&parts, wide));
    if let Some(a) = arena(&parts) {
        out.push_str(&a.text());
        out.push('\n');
    }
    out.push_str(&extras);
    for n in shard_notices(&parts) {
        out.push_str(&format!("  Notice: {n}\n"));
    }
    out.push_str(&format!(
        "  Stream shards: {} in use (a lock each; peak in use above is the sum of their peaks, an upper bound):",
        parts.len()
    ));
    for p in &parts {
        out.push_str(&format!(
            " [{}] {} in use / {} reserved;",
            p.shard,
            human_bytes(p.stats.used_bytes as usize),
            human_bytes(p.stats.total_bytes as usize)
        ));
    }
    out.pop();
    out.push('\n');
    for p in parts.iter().filter(|p| p.tag.is_some()) {
        let state = if p.paused > 0 { format!(", paused: {} given back to the driver", human_bytes(p.paused)) } else { String::new() };
        out.push_str(&format!(
            "  Tag {:?}: {} in use / {} reserved{state}\n",
            p.tag.as_deref().unwrap_or_default(),
            human_bytes(p.stats.used_bytes as usize),
            human_bytes(p.stats.total_bytes as usize)
        ));
    }
    out.push_str(&format!("  Driver calls: {}\n", calls(&parts).text()));
    Ok(out)
}

/// `device`'s statistics as JSON (`gpupool_stats_json`); a sharded device adds `shards`.
pub fn stats_json(device: i32) -> Result<String> {
    let ((own, extras, ctx), parts, wide) = parts(device, |p| (p.stats_json(), p.json_extras(None), p.report_context()))?;
    if wide.is_none() {
        return Ok(own);
    }
    let mut out = render_json(&ctx, &total(&parts, wide));
    out.pop();
    out.push_str(&format!(",\"driver_calls\":{}", calls(&parts).json()));
    if let Some(a) = arena(&parts) {
        out.push_str(&format!(",\"arena\":{}", a.json()));
    }
    out.push_str(&extras);
    let notices = shard_notices(&parts);
    if !notices.is_empty() {
        let esc: Vec<String> = notices.iter().map(|n| format!("\"{}\"", n.replace('\\', "\\\\").replace('"', "\\\""))).collect();
        out.push_str(&format!(",\"shard_notices\":[{}]", esc.join(",")));
    }
    let shards: Vec<String> = parts
        .iter()
        .map(|p| {
            format!(
                "{{\"shard\":{},\"strategy\":\"{}\",\"used_bytes\":{},\"total_bytes\":{},\"peak_used_bytes\":{},\"peak_requested_bytes\":{},\"n_allocs\":{}}}",
                p.shard, p.strategy, p.stats.used_bytes, p.stats.total_bytes, p.stats.peak_used_bytes, p.stats.peak_requested_bytes, p.stats.n_allocs
            )
        })
        .collect();
    let tags: Vec<String> = parts
        .iter()
        .filter_map(|p| {
            let name = p.tag.as_ref()?.replace('\\', "\\\\").replace('"', "\\\"");
            Some(format!(
                "\"{name}\":{{\"memory\":\"{}\",\"used_bytes\":{},\"total_bytes\":{},\"paused_bytes\":{},\"n_live_blocks\":{}}}",
                crate::tags::memory(p.shard as usize - super::SHARDS).name(),
                p.stats.used_bytes,
                p.stats.total_bytes,
                p.paused,
                p.stats.n_live_blocks
            ))
        })
        .collect();
    out.push_str(&format!(",\"tags\":{{{}}}", tags.join(",")));
    out.push_str(&format!(",\"shards\":[{}]}}", shards.join(",")));
    Ok(out)
}

/// `device`'s memory snapshot: every shard's segments in one list.
pub fn snapshot_json(device: i32) -> Result<String> {
    let (head, _, _) = parts(device, |p| format!("{{\"device\":{},\"strategy\":\"{}\",\"segments\":[", p.device(), p.strategy_name()))?;
    let mut segments = Vec::new();
    for_each_shard(device, |p| {
        let s = p.snapshot_segments();
        if !s.is_empty() {
            segments.push(s);
        }
    })?;
    Ok(format!("{head}{}]}}", segments.join(",")))
}
