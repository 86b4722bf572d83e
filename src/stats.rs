//! Counters and reports: the ABI-stable stats struct, the human `memory_status` text and
//! its JSON twin. Both reports are rendered from one `Stats` snapshot so their numbers agree.

use crate::error::human_bytes;
use std::fmt::Write;

/// Layout version of `Stats`; bumped only when fields are appended.
pub const STATS_VERSION: u32 = 2;

/// `sizeof(gpupool_stats)` of layout version 1: what `struct_size == 0` means. Frozen:
/// when fields are appended, this stays the number it is.
pub const STATS_V1_SIZE: usize = 184;

/// `sizeof(gpupool_stats)` of layout version 2 (`peak_requested_bytes` appended).
pub const STATS_V2_SIZE: usize = 192;
const _: () = assert!(STATS_V2_SIZE == std::mem::size_of::<Stats>());

/// The layout version a struct of `size` bytes holds whole: what `struct_size` callers
/// get stamped with `version` (a version-1 caller reads version 1).
pub fn stats_version_of(size: usize) -> u32 {
    if size >= STATS_V2_SIZE {
        2
    } else {
        1
    }
}

/// Per-device pool statistics (`gpupool_stats` in C).
///
/// ABI: set `struct_size` to `sizeof(gpupool_stats)` (or leave it 0, meaning version 1's
/// size) before calling `gpupool_get_stats`; the library writes at most that many bytes and
/// stamps `struct_size`/`version` with what it filled. Fields are only ever appended.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub struct_size: u32,
    pub version: u32,
    /// Bytes in blocks handed out and not yet freed (CuPy's `used_bytes`).
    pub used_bytes: u64,
    /// Bytes held from the upstream but not in use: cached (CuPy's `free_bytes`).
    pub free_bytes: u64,
    /// Bytes of memory held from the upstream (CuPy's `total_bytes`): segments, less the
    /// pages decommitted inside them (`vmm`, `host`).
    pub total_bytes: u64,
    /// Cached free blocks (CuPy's `n_free_blocks`), including blocks freed into a thread's
    /// cache for that thread's next allocation of the same size.
    pub n_free_blocks: u64,
    /// Live allocations (blocks kept in thread caches were freed: they are not counted).
    pub n_live_blocks: u64,
    /// Bytes the callers asked for (before rounding) in live allocations.
    pub requested_bytes: u64,
    pub peak_used_bytes: u64,
    pub peak_total_bytes: u64,
    pub n_allocs: u64,
    pub n_frees: u64,
    pub n_upstream_allocs: u64,
    pub n_upstream_frees: u64,
    pub n_ooms: u64,
    /// Calls of reclaim (explicit, or `empty_cache`).
    pub n_reclaims: u64,
    /// Bytes given back to the upstream by reclaims, OOM recovery and cache decay.
    pub reclaimed_bytes: u64,
    /// Frees of pointers gpupool did not own (unknown, interior, double).
    pub n_invalid_frees: u64,
    /// Reserved-bytes cap; 0 = none.
    pub limit_bytes: u64,
    pub largest_free_block: u64,
    /// Device memory as the driver reports it (0 when unknown).
    pub device_free_bytes: u64,
    pub device_total_bytes: u64,
    /// Cached blocks handed to another stream after waiting on, or finding complete, the
    /// freeing stream's event.
    pub n_cross_stream_reuses: u64,
    /// Frees deferred until streams passed to `record_stream` finish.
    pub n_deferred_frees: u64,
    /// Version 2: the peak of `requested_bytes` (PyTorch's `requested_bytes.all.peak`), the
    /// bytes callers asked for before rounding, beside `peak_used_bytes`, the blocks' sizes.
    pub peak_requested_bytes: u64,
}

impl Stats {
    /// Fragmentation of cached memory: 1 − largest free block / cached bytes (0 = one block).
    pub fn fragmentation(&self) -> f64 {
        if self.free_bytes == 0 {
            0.0
        } else {
            1.0 - self.largest_free_block as f64 / self.free_bytes as f64
        }
    }
}

/// What a report needs beside the numbers.
pub struct ReportContext<'a> {
    pub device: i32,
    pub strategy: &'a str,
    pub upstream: &'a str,
}

/// Human report, in the spirit of CUDA.jl's `memory_status()`.
pub fn render_status(ctx: &ReportContext, s: &Stats) -> String {
    let h = |n: u64| human_bytes(n as usize);
    let mut o = String::new();
    let _ = writeln!(o, "gpupool device {} ({} pool on {} upstream)", ctx.device, ctx.strategy, ctx.upstream);
    if s.device_total_bytes > 0 {
        let used = s.device_total_bytes - s.device_free_bytes;
        let _ = writeln!(
            o,
            "  Effective device usage: {:.2}% ({} / {})",
            100.0 * used as f64 / s.device_total_bytes as f64,
            h(used),
            h(s.device_total_bytes)
        );
    }
    let _ = writeln!(
        o,
        "  Pool usage: {} in use, {} cached, {} reserved (peak: {} in use, {} reserved)",
        h(s.used_bytes),
        h(s.free_bytes),
        h(s.total_bytes),
        h(s.peak_used_bytes),
        h(s.peak_total_bytes)
    );
    let _ = writeln!(o, "  Limit: {}", if s.limit_bytes == 0 { "none".into() } else { h(s.limit_bytes) });
    let _ = writeln!(
        o,
        "  Blocks: {} live, {} free; largest free block {}; fragmentation {:.1}%",
        s.n_live_blocks,
        s.n_free_blocks,
        h(s.largest_free_block),
        100.0 * s.fragmentation()
    );
    let _ = writeln!(
        o,
        "  Counts: {} allocs, {} frees, {} upstream allocs, {} upstream frees, {} OOMs, {} reclaims ({} released), {} invalid frees, {} cross-stream reuses, {} deferred frees",
        s.n_allocs,
        s.n_frees,
        s.n_upstream_allocs,
        s.n_upstream_frees,
        s.n_ooms,
        s.n_reclaims,
        h(s.reclaimed_bytes),
        s.n_invalid_frees,
        s.n_cross_stream_reuses,
        s.n_deferred_frees
    );
    o
}

/// JSON form of the same numbers (one object per device).
pub fn render_json(ctx: &ReportContext, s: &Stats) -> String {
    format!(
        concat!(
            "{{\"device\":{},\"strategy\":\"{}\",\"upstream\":\"{}\",",
            "\"used_bytes\":{},\"free_bytes\":{},\"total_bytes\":{},\"n_free_blocks\":{},\"n_live_blocks\":{},",
            "\"requested_bytes\":{},\"peak_used_bytes\":{},\"peak_total_bytes\":{},\"n_allocs\":{},\"n_frees\":{},",
            "\"n_upstream_allocs\":{},\"n_upstream_frees\":{},\"n_ooms\":{},\"n_reclaims\":{},\"reclaimed_bytes\":{},",
            "\"n_invalid_frees\":{},\"limit_bytes\":{},\"largest_free_block\":{},\"fragmentation\":{:.6},",
            "\"device_free_bytes\":{},\"device_total_bytes\":{},\"n_cross_stream_reuses\":{},\"n_deferred_frees\":{},",
            "\"peak_requested_bytes\":{}}}"
        ),
        ctx.device,
        ctx.strategy,
        ctx.upstream,
        s.used_bytes,
        s.free_bytes,
        s.total_bytes,
        s.n_free_blocks,
        s.n_live_blocks,
        s.requested_bytes,
        s.peak_used_bytes,
        s.peak_total_bytes,
        s.n_allocs,
        s.n_frees,
        s.n_upstream_allocs,
        s.n_upstream_frees,
        s.n_ooms,
        s.n_reclaims,
        s.reclaimed_bytes,
        s.n_invalid_frees,
        s.limit_bytes,
        s.largest_free_block,
        s.fragmentation(),
        s.device_free_bytes,
        s.device_total_bytes,
        s.n_cross_stream_reuses,
        s.n_deferred_frees,
        s.peak_requested_bytes
    )
}
