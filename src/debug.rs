//! Leak tracking (`GPUPOOL_DEBUG`): what each live allocation records, the leak report, and
//! the at-exit summary.
//!
//! - 0 (default): nothing is recorded; the hot path pays one predictable branch.
//! - 1: size, device, stream and time of each live allocation; at exit, one line per leak.
//! - 2: level 1 plus a backtrace of the caller, symbolised only when a report is made.

use crate::error::human_bytes;
use std::backtrace::Backtrace;
use std::fmt::Write;
use std::time::Instant;

/// What `GPUPOOL_DEBUG >= 1` keeps for one live allocation.
pub struct AllocRecord {
    pub at: Instant,
    pub stream: usize,
    pub backtrace: Option<Backtrace>,
}

impl AllocRecord {
    pub fn capture(level: u8, stream: usize) -> Option<Box<AllocRecord>> {
        if level == 0 {
            return None;
        }
        Some(Box::new(AllocRecord {
            at: Instant::now(),
            stream,
            backtrace: (level >= 2).then(Backtrace::force_capture),
        }))
    }
}

/// One outstanding allocation, as the report lists it.
pub struct Leak {
    pub device: i32,
    pub addr: usize,
    pub size: usize,
    pub requested: usize,
    /// Stream and age in seconds (GPUPOOL_DEBUG >= 1).
    pub stream_age: Option<(usize, f64)>,
    /// Symbolised caller frames (GPUPOOL_DEBUG=2).
    pub frames: Vec<String>,
}

impl Leak {
    pub fn new(device: i32, addr: usize, size: usize, requested: usize, rec: Option<&AllocRecord>) -> Leak {
        Leak {
            device,
            addr,
            size,
            requested,
            stream_age: rec.map(|r| (r.stream, r.at.elapsed().as_secs_f64())),
            frames: rec.and_then(|r| r.backtrace.as_ref()).map(caller_frames).unwrap_or_default(),
        }
    }
}

/// Frames of gpupool itself and of the Rust runtime say nothing about the caller: drop them.
fn caller_frames(bt: &Backtrace) -> Vec<String> {
    let text = bt.to_string();
    let mut out = Vec::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let t = line.trim();
        let Some((_, name)) = t.split_once(": ") else { continue };
        if !t.chars().next().is_some_and(|c| c.is_ascii_digit()) {
            continue;
        }
        let location = match lines.peek() {
            Some(l) if l.trim().starts_with("at ") => lines.next().map(|l| l.trim().to_string()),
            _ => None,
        };
        let internal = name.starts_with("gpupool::")
            || name.starts_with("std::")
            || name.starts_with("core::")
            || name.starts_with("alloc::")
            || name.starts_with("<")
            || name.contains("__rust")
            || name.starts_with("gpupool_malloc")
            || name.starts_with("gpupool_torch_malloc")
            || name.starts_with("gpupool_cupy_malloc")
            || name.starts_with("gpupool_pinned_malloc");
        if internal && out.is_empty() {
            continue;
        }
        out.push(match location {
            Some(l) => format!("{name} {l}"),
            None => name.to_string(),
        });
        if out.len() >= 12 {
            break;
        }
    }
    out
}

/// The leak report: outstanding allocations, largest first.
pub fn render(mut leaks: Vec<Leak>, level: u8) -> String {
    leaks.sort_by(|a, b| b.size.cmp(&a.size).then(a.addr.cmp(&b.addr)));
    let total: usize = leaks.iter().map(|l| l.size).sum();
    let mut o = String::new();
    let _ = writeln!(o, "gpupool: {} live allocation(s), {} outstanding", leaks.len(), human_bytes(total));
    if level == 0 && !leaks.is_empty() {
        let _ = writeln!(o, "  (set GPUPOOL_DEBUG=2 for the age, stream and backtrace of each)");
    }
    for l in &leaks {
        let _ = write!(o, "  {} ({} requested) at {:#x} on device {}", human_bytes(l.size), l.requested, l.addr, l.device);
        if let Some((stream, age)) = l.stream_age {
            let _ = write!(o, ", stream {stream:#x}, age {age:.3} s");
        }
        let _ = writeln!(o);
        for f in &l.frames {
            let _ = writeln!(o, "      {f}");
        }
    }
    o
}
