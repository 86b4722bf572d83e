//! Configuration: the ONLY module that reads environment variables.
//!
//! Every value is parsed into a typed setting; a malformed value is an `Error::InvalidConfig`
//! naming the variable, the value and what is accepted — never a silent default.
//! Parsing is separated from the environment (`Config::from_lookup`) so tests can feed values.

use crate::error::{Error, Result};
use std::path::PathBuf;

/// Which caching policy a device pool uses (`GPUPOOL_POOL`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum PoolKind {
    /// Best fit with splitting and coalescing (the segment pool; the arena is the default).
    Split,
    /// Power-of-two bins, whole blocks (CUDA.jl's `binned`).
    Binned,
    /// No caching: every call goes to the upstream.
    None,
    /// Virtual-memory arena: coalescing across one reserved address range, free granules
    /// moved where a request needs them (`strategy/arena`). Falls back to `split` where the
    /// device has no virtual memory management.
    Arena,
}

impl PoolKind {
    pub const ACCEPTED: &'static str = "split | binned | none | arena";
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "split" => Some(PoolKind::Split),
            "binned" => Some(PoolKind::Binned),
            "none" | "passthrough" => Some(PoolKind::None),
            "arena" => Some(PoolKind::Arena),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            PoolKind::Split => "split",
            PoolKind::Binned => "binned",
            PoolKind::None => "none",
            PoolKind::Arena => "arena",
        }
    }
}

/// Where raw memory comes from (`GPUPOOL_UPSTREAM`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum UpstreamKind {
    /// `cuMemAlloc` / `cuMemFree` (default).
    Device,
    /// `cuMemAllocManaged`.
    Managed,
    /// `cuMemAllocAsync` / `cuMemFreeAsync` on the caller's stream.
    Async,
    /// Page-mapped device memory (`cuMemCreate` + `cuMemMap`): pages inside segments can
    /// be given back.
    Vmm,
    /// Aligned host memory: tests and the no-GPU demo.
    Host,
}

impl UpstreamKind {
    pub const ACCEPTED: &'static str = "device | vmm | managed | async | host";
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "device" | "cuda" => Some(UpstreamKind::Device),
            "managed" => Some(UpstreamKind::Managed),
            "async" => Some(UpstreamKind::Async),
            "vmm" => Some(UpstreamKind::Vmm),
            "host" => Some(UpstreamKind::Host),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            UpstreamKind::Device => "device",
            UpstreamKind::Managed => "managed",
            UpstreamKind::Async => "async",
            UpstreamKind::Vmm => "vmm",
            UpstreamKind::Host => "host",
        }
    }
}

/// A memory limit as written by the user: absolute or relative to the device total.
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum LimitSpec {
    Bytes(usize),
    /// Percent of the device's total memory, 0 < p <= 100.
    Percent(f64),
}

impl LimitSpec {
    pub const ACCEPTED: &'static str =
        "bytes (1073741824), a size with unit (512MiB, 8GiB, 8GB, 8G, 100KB; K/M/G/T and KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB of 1024), or a percentage of device memory (50%)";

    /// Resolve against the device total (needed only for percentages).
    pub fn resolve(self, device_total: usize) -> usize {
        match self {
            LimitSpec::Bytes(b) => b,
            LimitSpec::Percent(p) => ((device_total as f64) * p / 100.0) as usize,
        }
    }
}

/// Parse `1073741824`, `512MiB`, `8 GiB`, `8GB`, `50%`.
pub fn parse_limit(s: &str) -> Option<LimitSpec> {
    let t = s.trim();
    if let Some(p) = t.strip_suffix('%') {
        let v: f64 = p.trim().parse().ok()?;
        return (v.is_finite() && v > 0.0 && v <= 100.0).then_some(LimitSpec::Percent(v));
    }
    parse_size(t).map(LimitSpec::Bytes)
}

/// `var`'s value `v` as a byte count greater than zero, or the error naming `var`.
fn positive_size(var: &'static str, v: &str, accepted: &'static str) -> Result<usize> {
    parse_size(v).filter(|&b| b > 0).ok_or_else(|| Error::InvalidConfig { var, value: v.to_string(), accepted })
}

/// Parse a byte count with an optional unit. Rejects overflow, negatives, fractions of a byte.
pub fn parse_size(s: &str) -> Option<usize> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return None;
    }
    let mult: u128 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1000,
        "m" | "mb" => 1000u128.pow(2),
        "g" | "gb" => 1000u128.pow(3),
        "t" | "tb" => 1000u128.pow(4),
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        _ => return None,
    };
    let bytes: u128 = if num.contains('.') {
        // Fractions are accepted with a unit (1.5GiB) and must come to whole bytes after it.
        let v: f64 = num.parse().ok()?;
        let b = v * mult as f64;
        if !b.is_finite() || b.fract() != 0.0 || b > usize::MAX as f64 {
            return None;
        }
        b as u128
    } else {
        num.parse::<u128>().ok()?.checked_mul(mult)?
    };
    usize::try_from(bytes).ok()
}

/// Everything the environment can set. Built once per process for the C API.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// `GPUPOOL_POOL` (default `arena`: it holds what is live where `split` holds its worst
    /// fragmentation; where the device has no VMM the pool falls back to `split`).
    pub pool: PoolKind,
    pub upstream: UpstreamKind,
    pub limit: Option<LimitSpec>,
    /// Capacity of the simulated device behind the host upstream (default: 16 GiB).
    pub host_capacity: usize,
    /// `GPUPOOL_DEBUG`: 0 off, 1 leak summary at exit, 2 backtraces for every live allocation.
    pub debug: u8,
    /// `GPUPOOL_TRACE`: CSV file receiving one row per event.
    pub trace: Option<PathBuf>,
    /// `GPUPOOL_CHECK_INVARIANTS=1`: full invariant scan after every operation (tests).
    pub check_invariants: bool,
    /// `GPUPOOL_UNSAFE_IGNORE_STREAMS=1`: TEST ONLY — reuse blocks across streams with no
    /// synchronisation. Exists so the stream-safety stress test can show it catches a pool
    /// that ignores streams. Never set it in real programs.
    pub unsafe_ignore_streams: bool,
    /// `GPUPOOL_DECAY`: allocations a cached byte may sit unneeded before it goes back to
    /// the driver (`decay.rs`); 0 / `off` keeps everything cached until reclaim.
    pub decay_window: usize,
    /// `GPUPOOL_THREAD_CACHE` (default on): the per-thread fast path (`crate::thread_cache`).
    pub thread_cache: bool,
    /// `GPUPOOL_EVENT_BATCH` (default 256): frees on a user stream per event record; 1
    /// records at every free (`crate::stream`).
    pub event_batch: usize,
    /// `GPUPOOL_EVENT_BATCH_BYTES` (default 256 MiB): bytes a user stream may leave freed
    /// with no record before its next free records (`crate::stream`).
    pub event_batch_bytes: usize,
    /// `GPUPOOL_ARENA_LEND` (default on): the arena's two ranges grow into each other's free
    /// granules (an alias each) before mapping new memory; `0` turns it off.
    pub arena_lend: bool,
    /// `GPUPOOL_ARENA_CHUNK` (default 256 MiB): the largest physical allocation the arena
    /// maps for a long growth (`strategy/arena/chunks.rs`); `0` maps granule by granule.
    pub arena_chunk: usize,
    /// `GPUPOOL_ARENA_CHUNK_FROM` (default 64 MiB): growths of at least this many bytes are
    /// mapped as chunks (`strategy/arena/chunks.rs`); lower it to trade memory on workloads
    /// of mixed sizes for fewer allocations (fewer driver calls, and fewer imports for a
    /// process that shares its tensors).
    pub arena_chunk_from: usize,
    /// `GPUPOOL_ARENA_PIECE_ENDS` (default off): a new stitch may begin in the free end of
    /// a granule partly in use and end in the free start of another (`strategy/arena/plan.rs`,
    /// `piece_ends`): less new memory at new peaks, more stitches.
    pub arena_piece_ends: bool,
    /// `GPUPOOL_STREAM_SHARDS` (default 16, at most `MAX_STREAM_SHARDS`): user streams are
    /// spread over this many shards of each device's pool, each with its own lock, so
    /// threads on different streams do not wait for each other (`crate::registry`); 0
    /// keeps one pool per device.
    pub stream_shards: usize,
    /// `GPUPOOL_ARENA_VA`: address space the arena reserves for large blocks (default:
    /// twice the device's memory, for each shard of the device; `pool::arena::build`).
    pub arena_va: Option<usize>,
    /// `GPUPOOL_STATUS_SOCKET=1`: answer status requests from other processes on a Unix
    /// socket (`status_socket.rs`; `python -m gpupool status --pid PID`).
    pub status_socket: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            pool: PoolKind::Arena,
            upstream: UpstreamKind::Device,
            limit: None,
            host_capacity: 16 << 30,
            debug: 0,
            trace: None,
            check_invariants: false,
            unsafe_ignore_streams: false,
            decay_window: crate::decay::DEFAULT_WINDOW,
            thread_cache: true,
            event_batch: EVENT_BATCH,
            event_batch_bytes: EVENT_BATCH_BYTES,
            arena_lend: true,
            arena_piece_ends: false,
            arena_chunk: ARENA_CHUNK,
            arena_chunk_from: ARENA_CHUNK_FROM,
            stream_shards: STREAM_SHARDS,
            arena_va: None,
            status_socket: false,
        }
    }
}

/// `GPUPOOL_ARENA_CHUNK`'s default: the largest physical allocation the arena maps at once.
pub const ARENA_CHUNK: usize = 256 << 20;
/// `GPUPOOL_ARENA_CHUNK_FROM`'s default: the shortest growth the arena maps as chunks.
pub const ARENA_CHUNK_FROM: usize = 64 << 20;

/// `GPUPOOL_STREAM_SHARDS`'s default and its largest accepted value.
pub const STREAM_SHARDS: usize = 16;
pub const MAX_STREAM_SHARDS: usize = 32;

/// `GPUPOOL_EVENT_BATCH`'s default: user-stream frees per event record (`crate::stream`).
/// Why 256 and not fewer: an event record is a driver call into the device's one context,
/// and threads recording at once block each other inside the driver: with frequent records,
/// 16 threads on 16 streams switch context thousands of times and lose a large part of 16
/// processes' throughput (docs/benchmarks.md links the measurements). The starting
/// point: a stream nobody borrows from doubles its own batch (`crate::stream`).
pub const EVENT_BATCH: usize = 256;

/// `GPUPOOL_EVENT_BATCH_BYTES`'s default: bytes a user stream may leave unrecorded. A bigger
/// free records at once, so memory that matters to other streams becomes theirs with no
/// delay. What waits is only cross-stream reuse: a pending block serves its own stream at
/// once, another stream refused one makes the next free record (`wanted`), and pressure
/// waits for the device; PyTorch's allocator never hands one stream's blocks to another.
pub const EVENT_BATCH_BYTES: usize = 256 << 20;

fn bool_flag(var: &'static str, v: &str) -> Result<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "" | "0" | "false" | "no" | "off" => Ok(false),
        "1" | "true" | "yes" | "on" => Ok(true),
        _ => Err(Error::InvalidConfig { var, value: v.to_string(), accepted: "0 | 1 (also true/false, yes/no, on/off)" }),
    }
}

static CONFIG: std::sync::OnceLock<Result<Config>> = std::sync::OnceLock::new();

/// The environment's configuration, parsed once per process; a malformed value is returned
/// as an error by every call that needs it. The first call also warns about `GPUPOOL_*`
/// variables nothing reads (`warn_unknown_variables`).
pub fn get() -> Result<&'static Config> {
    CONFIG
        .get_or_init(|| {
            warn_unknown_variables();
            Config::from_env()
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// Every variable `Config::from_lookup` reads.
pub const VARIABLES: [&str; 19] = [
    "GPUPOOL_POOL",
    "GPUPOOL_UPSTREAM",
    "GPUPOOL_MEMORY_LIMIT",
    "GPUPOOL_HOST_CAPACITY",
    "GPUPOOL_DEBUG",
    "GPUPOOL_TRACE",
    "GPUPOOL_CHECK_INVARIANTS",
    "GPUPOOL_UNSAFE_IGNORE_STREAMS",
    "GPUPOOL_THREAD_CACHE",
    "GPUPOOL_EVENT_BATCH",
    "GPUPOOL_EVENT_BATCH_BYTES",
    "GPUPOOL_STREAM_SHARDS",
    "GPUPOOL_ARENA_LEND",
    "GPUPOOL_ARENA_CHUNK",
    "GPUPOOL_ARENA_CHUNK_FROM",
    "GPUPOOL_ARENA_PIECE_ENDS",
    "GPUPOOL_STATUS_SOCKET",
    "GPUPOOL_ARENA_VA",
    "GPUPOOL_DECAY",
];

/// Variables of the project that the library does not read: the Python package's (first
/// three, which users set too), then those of its tests, scripts and CMake build. Never
/// warned about (`tests/env_names.rs` checks every `GPUPOOL_` name of the repository is
/// here, in `VARIABLES`, or no environment variable at all).
pub const OTHER_VARIABLES: [&str; 14] = [
    "GPUPOOL_LIBRARY",
    "GPUPOOL_TORCH_ALLOCATOR",
    "GPUPOOL_SHARE_AHEAD",
    "GPUPOOL_TEST_INSTALLED",
    "GPUPOOL_MODEL_OPS",
    "GPUPOOL_ARENA_MODEL_OPS",
    "GPUPOOL_FAULT_OPS",
    "GPUPOOL_BLESS",
    "GPUPOOL_VENV",
    "GPUPOOL_BUILD_EXAMPLES",
    "GPUPOOL_BUILD_TESTS",
    "GPUPOOL_RMM_ROOT",
    "GPUPOOL_RAPIDS_LOGGER_ROOT",
    "GPUPOOL_SOURCE",
];

impl Config {
    /// Read the process environment.
    pub fn from_env() -> Result<Config> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Parse from any key → value lookup (tests pass a map).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Config> {
        let mut c = Config::default();
        if let Some(v) = get("GPUPOOL_POOL") {
            c.pool = PoolKind::parse(&v).ok_or(Error::InvalidConfig {
                var: "GPUPOOL_POOL",
                value: v.clone(),
                accepted: PoolKind::ACCEPTED,
            })?;
        }
        if let Some(v) = get("GPUPOOL_UPSTREAM") {
            c.upstream = UpstreamKind::parse(&v).ok_or(Error::InvalidConfig {
                var: "GPUPOOL_UPSTREAM",
                value: v.clone(),
                accepted: UpstreamKind::ACCEPTED,
            })?;
        }
        if let Some(v) = get("GPUPOOL_MEMORY_LIMIT") {
            // An empty value means "unset", the way shells unset variables with VAR=.
            if !v.trim().is_empty() {
                let spec = parse_limit(&v).ok_or(Error::InvalidConfig {
                    var: "GPUPOOL_MEMORY_LIMIT",
                    value: v.clone(),
                    accepted: LimitSpec::ACCEPTED,
                })?;
                c.limit = Some(spec);
            }
        }
        if let Some(v) = get("GPUPOOL_HOST_CAPACITY") {
            c.host_capacity = positive_size("GPUPOOL_HOST_CAPACITY", &v, "a size greater than zero: bytes or a size with unit (4GiB)")?;
        }
        if let Some(v) = get("GPUPOOL_DEBUG") {
            c.debug = match v.trim() {
                "" | "0" => 0,
                "1" => 1,
                "2" => 2,
                _ => {
                    return Err(Error::InvalidConfig {
                        var: "GPUPOOL_DEBUG",
                        value: v,
                        accepted: "0 (off), 1 (leak summary at exit), 2 (backtrace per live allocation)",
                    })
                }
            };
        }
        if let Some(v) = get("GPUPOOL_TRACE") {
            if !v.trim().is_empty() {
                c.trace = Some(PathBuf::from(v));
            }
        }
        if let Some(v) = get("GPUPOOL_CHECK_INVARIANTS") {
            c.check_invariants = bool_flag("GPUPOOL_CHECK_INVARIANTS", &v)?;
        }
        if let Some(v) = get("GPUPOOL_UNSAFE_IGNORE_STREAMS") {
            c.unsafe_ignore_streams = bool_flag("GPUPOOL_UNSAFE_IGNORE_STREAMS", &v)?;
        }
        if let Some(v) = get("GPUPOOL_THREAD_CACHE") {
            c.thread_cache = bool_flag("GPUPOOL_THREAD_CACHE", &v)?;
        }
        if let Some(v) = get("GPUPOOL_EVENT_BATCH") {
            c.event_batch = v.trim().parse().ok().filter(|&n: &usize| (1..=4096).contains(&n)).ok_or(Error::InvalidConfig {
                var: "GPUPOOL_EVENT_BATCH",
                value: v.clone(),
                accepted: "a number of frees from 1 (record an event at every free on a user stream) to 4096; default 256",
            })?;
        }
        if let Some(v) = get("GPUPOOL_EVENT_BATCH_BYTES") {
            c.event_batch_bytes = positive_size(
                "GPUPOOL_EVENT_BATCH_BYTES",
                &v,
                "a size greater than zero: bytes or a size with unit (256MiB); default 256MiB",
            )?;
        }
        if let Some(v) = get("GPUPOOL_STREAM_SHARDS") {
            c.stream_shards = v.trim().parse().ok().filter(|&n: &usize| n <= MAX_STREAM_SHARDS).ok_or(Error::InvalidConfig {
                var: "GPUPOOL_STREAM_SHARDS",
                value: v.clone(),
                accepted: "a number of shards from 0 (one pool per device) to 32; default 16",
            })?;
        }
        if let Some(v) = get("GPUPOOL_ARENA_LEND") {
            c.arena_lend = bool_flag("GPUPOOL_ARENA_LEND", &v)?;
        }
        if let Some(v) = get("GPUPOOL_ARENA_PIECE_ENDS") {
            c.arena_piece_ends = bool_flag("GPUPOOL_ARENA_PIECE_ENDS", &v)?;
        }
        if let Some(v) = get("GPUPOOL_ARENA_CHUNK") {
            c.arena_chunk = parse_size(&v).ok_or(Error::InvalidConfig {
                var: "GPUPOOL_ARENA_CHUNK",
                value: v.clone(),
                accepted: "a size: bytes or a size with unit (256MiB); 0 maps granule by granule",
            })?;
        }
        if let Some(v) = get("GPUPOOL_ARENA_CHUNK_FROM") {
            c.arena_chunk_from = parse_size(&v).ok_or(Error::InvalidConfig {
                var: "GPUPOOL_ARENA_CHUNK_FROM",
                value: v.clone(),
                accepted: "a size: bytes or a size with unit (64MiB); growths of at least this are mapped as chunks",
            })?;
        }
        if let Some(v) = get("GPUPOOL_STATUS_SOCKET") {
            c.status_socket = bool_flag("GPUPOOL_STATUS_SOCKET", &v)?;
        }
        if let Some(v) = get("GPUPOOL_ARENA_VA") {
            if !v.trim().is_empty() {
                // Less than one granule (the arena's mapping unit on every GPU) fits no block
                // at all: refused here, not as an out-of-memory error at the first malloc.
                let accepted = "a size of at least 2MiB, the arena's mapping unit: bytes or a size with unit (512GiB)";
                c.arena_va = Some(positive_size("GPUPOOL_ARENA_VA", &v, accepted).and_then(|b| {
                    if b >= 2 << 20 {
                        Ok(b)
                    } else {
                        Err(Error::InvalidConfig { var: "GPUPOOL_ARENA_VA", value: v.to_string(), accepted })
                    }
                })?);
            }
        }
        if let Some(v) = get("GPUPOOL_DECAY") {
            c.decay_window = match v.trim().to_ascii_lowercase().as_str() {
                "off" | "never" => 0,
                t => t.parse().map_err(|_| Error::InvalidConfig {
                    var: "GPUPOOL_DECAY",
                    value: v.to_string(),
                    accepted: "a number of allocations (32768 is a good start), or 0 / off (the default) to keep all cached memory",
                })?,
            };
        }
        Ok(c)
    }
}

mod unknown;
pub use unknown::unknown_variables;
use unknown::warn_unknown_variables;

#[cfg(test)]
mod tests;
