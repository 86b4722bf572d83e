//! What the C API, PyTorch's and CuPy's entries ask of a device (or every device) beyond
//! allocating and freeing: statistics and reports, peaks, limits, reclaiming cached memory,
//! run-time configuration, peer access, and questions about a live block. Each is one call
//! into the registry, with the rules that span devices (every device for -1, the first
//! error of several) made here once for every entry point.

use crate::config::{LimitSpec, PoolKind, UpstreamKind};
use crate::error::{BadPointer, Error, Result};
use crate::registry;
use crate::stats::Stats;

/// `device`'s statistics.
pub fn stats(device: i32) -> Result<Stats> {
    registry::stats(device)
}

/// Start `device`'s peaks again from what is in use and reserved now.
pub fn reset_peaks(device: i32) -> Result<()> {
    registry::reset_peaks(device)
}

/// Let `peer` access what gpupool maps on `device` (-1: all); the grants made now.
pub fn enable_peer_access(device: i32, peer: i32) -> Result<usize> {
    registry::enable_peer_access(device, peer)
}

/// Give every wholly free cached segment of `device` (-1: every device in use) back: the
/// bytes released, and the first error of a pool that could not release (the other devices
/// are still reclaimed, and their bytes counted). `Err`: nothing could be asked (a bad
/// device; for -1, settings no pool can be made under, said rather than nothing released).
pub fn reclaim(device: i32) -> Result<(usize, Option<Error>)> {
    if device == -1 {
        if let Some(e) = registry::settings_error() {
            return Err(e);
        }
    }
    let (mut total, mut first_err) = (0, None);
    let devices = if device == -1 { registry::existing_devices() } else { vec![device] };
    for d in devices {
        if let Some((n, err)) = registry::reclaim(d)? {
            total += n;
            if let Some(e) = err {
                first_err.get_or_insert(e);
            }
        }
    }
    Ok((total, first_err))
}

/// PyTorch's `empty_cache`: every device in use gives its wholly free cached memory back;
/// the first error of a pool that could not release. A device that cannot be asked (a
/// fork child's) is passed over, as no pool of it is in use.
pub fn empty_cache() -> Result<()> {
    let mut first = None;
    for d in registry::existing_devices() {
        if let Ok(Some((_, Some(e)))) = registry::reclaim(d) {
            first.get_or_insert(e);
        }
    }
    first.map_or(Ok(()), Err)
}

/// Cap `device`'s reserved bytes (0: no limit).
pub fn set_limit(device: i32, bytes: usize) -> Result<()> {
    registry::set_limit(device, bytes)
}

/// `set_limit` with the limit written as `GPUPOOL_MEMORY_LIMIT` takes it (bytes, a size
/// with unit, a percentage of the device).
pub fn set_limit_text(device: i32, text: &str) -> Result<()> {
    let spec = crate::config::parse_limit(text)
        .ok_or_else(|| Error::InvalidArgument(format!("limit {text:?}; accepted: {}", LimitSpec::ACCEPTED)))?;
    let total = total_memory(device)?;
    registry::set_limit(device, spec.resolve(total))
}

/// `set_limit` as `fraction` (within [0, 1]) of the device's memory: PyTorch's
/// `set_per_process_memory_fraction`.
pub fn set_limit_fraction(device: i32, fraction: f64) -> Result<()> {
    if !(fraction.is_finite() && (0.0..=1.0).contains(&fraction)) {
        return Err(Error::InvalidArgument(format!("memory fraction {fraction} is not within [0, 1]")));
    }
    let total = total_memory(device)?;
    registry::set_limit(device, ((total as f64) * fraction) as usize)
}

fn total_memory(device: i32) -> Result<usize> {
    registry::with_pool(device, |p| Ok(p.mem_info()?.1))
}

/// `device`'s limit (0: none).
pub fn limit(device: i32) -> Result<usize> {
    registry::with_pool(device, |p| Ok(p.budget().limit()))
}

/// A report of `device`, or of every device in use for -1, joined as `join` says (prefix,
/// separator, suffix). A device that cannot answer answers its error's text, which comes
/// back too (every device: those that cannot answer are left out).
fn report(device: i32, one: impl Fn(i32) -> Result<String>, join: (&str, &str, &str)) -> (String, Option<Error>) {
    if device == -1 {
        let parts: Vec<String> = registry::existing_devices().into_iter().filter_map(|d| one(d).ok()).collect();
        (format!("{}{}{}", join.0, parts.join(join.1), join.2), None)
    } else {
        match one(device) {
            Ok(s) => (s, None),
            Err(e) => (e.to_string(), Some(e)),
        }
    }
}

/// The human-readable report of `device` (-1: every device in use). Where no pool is in
/// use because the environment's configuration is malformed, the report is that error.
pub fn memory_status(device: i32) -> (String, Option<Error>) {
    let (s, err) = report(device, registry::memory_status, ("", "", ""));
    if !s.is_empty() {
        return (s, err);
    }
    // A malformed configuration keeps every pool from being made: "no pool yet" would hide why.
    match registry::settings_error() {
        Some(e) => (format!("{e}\n"), Some(e)),
        None => ("gpupool: no device pool in use yet\n".into(), None),
    }
}

/// The statistics as JSON: an object for a device, an array for -1.
pub fn stats_json(device: i32) -> (String, Option<Error>) {
    report(device, registry::stats_json, ("[", ",", "]"))
}

/// The segments and blocks as JSON: an object for a device, an array for -1.
pub fn snapshot_json(device: i32) -> (String, Option<Error>) {
    report(device, registry::snapshot_json, ("[", ",", "]"))
}

/// Every live allocation of every device, largest first.
pub fn leak_report() -> String {
    registry::leak_report()
}

/// Where process `pid` answers status requests (`GPUPOOL_STATUS_SOCKET`).
pub fn status_socket_path(pid: u32) -> std::path::PathBuf {
    crate::status_socket::path_for(pid)
}

/// Choose `device`'s strategy and/or upstream by name (None keeps the current one).
pub fn configure(device: i32, pool: Option<&str>, upstream: Option<&str>) -> Result<()> {
    let pk = match pool {
        None => None,
        Some(s) => Some(
            PoolKind::parse(s)
                .ok_or_else(|| Error::InvalidArgument(format!("pool {s:?} is not one of: {}", PoolKind::ACCEPTED)))?,
        ),
    };
    let uk = match upstream {
        None => None,
        Some(s) => Some(UpstreamKind::parse(s).ok_or_else(|| {
            Error::InvalidArgument(format!("upstream {s:?} is not one of: {}", UpstreamKind::ACCEPTED))
        })?),
    };
    registry::configure(device, pk, uk)
}

/// The number of CUDA devices (`Error::NoDriver` without libcuda).
pub fn device_count() -> Result<i32> {
    crate::upstream::cuda::driver::device_count()
}

/// Load the CUDA driver now, so the first allocation does not pay it.
pub fn load_driver() -> Result<()> {
    crate::upstream::cuda::driver::ensure_driver()
}

/// Mark that `stream` uses the live block `ptr` (any device).
pub fn record_stream(ptr: usize, stream: usize) -> Result<()> {
    if ptr == 0 {
        return Err(Error::NullArgument("ptr"));
    }
    // No device owns it: say what was asked, not a free on device -1.
    let why = BadPointer::Refused("record_stream: not a block gpupool allocated on any device".into());
    registry::with_owner_of(ptr, |pool| pool.record_stream(ptr, stream)).unwrap_or(Err(Error::InvalidPointer { ptr, device: -1, why }))
}

/// The size of the block holding the live allocation `ptr` (None: no live allocation).
pub fn block_size(ptr: usize) -> Option<usize> {
    registry::with_owner_of(ptr, |pool| pool.block_size(ptr)).and_then(|r| r.ok())
}

/// The upstream allocation holding `ptr`: (base, length).
pub fn segment_of(ptr: usize) -> Result<(usize, usize)> {
    registry::with_owner_of(ptr, |pool| pool.segment_of(ptr))
        .unwrap_or(Err(Error::InvalidPointer { ptr, device: -1, why: BadPointer::Unknown }))
}
