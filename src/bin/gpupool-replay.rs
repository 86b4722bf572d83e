//! gpupool-replay: replay a GPUPOOL_TRACE file against a simulated device and compare
//! strategies. Usage: gpupool-replay TRACE.csv [--pool split|binned|none|arena|all] [--device-size 80GiB] [--decay N|off] [--upstream device|vmm] [--no-arena-lend] [--arena-piece-ends] [--arena-chunk 256MiB|0] [--arena-chunk-from 64MiB] [--steps FIRST,EVERY,WARMUP]

use gpupool::config::{parse_size, PoolKind};
use gpupool::error::human_bytes;
use gpupool::pool::PoolOptions;
use gpupool::replay::{parse, replay_with_progress, second_half_off_peak, Report, Steps};
use std::io::{IsTerminal, Write};
use std::process::ExitCode;

const USAGE: &str = "usage: gpupool-replay TRACE.csv [--pool split|binned|none|arena|all] [--device-size 80GiB] [--decay N|off] [--upstream device|vmm] [--no-arena-lend] [--arena-piece-ends] [--arena-chunk 256MiB|0] [--arena-chunk-from 64MiB] [--steps FIRST,EVERY,WARMUP]";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut path = None;
    let mut pools = vec![PoolKind::Split, PoolKind::Binned, PoolKind::None, PoolKind::Arena];
    let mut device_size = 80usize << 30;
    let mut decay_window = gpupool::decay::DEFAULT_WINDOW;
    let mut arena_lend = true;
    let mut arena_piece_ends = false;
    let mut arena_chunk = gpupool::strategy::arena::CHUNK_MAX;
    let mut arena_chunk_from = gpupool::strategy::arena::CHUNK_FROM;
    let mut paged = false;
    let mut steps = None;
    let mut i = 0;
    while i < args.len() {
        match args[i].as_str() {
            "--pool" => {
                i += 1;
                match args.get(i).map(String::as_str) {
                    Some("all") => {}
                    Some(s) => match PoolKind::parse(s) {
                        Some(k) => pools = vec![k],
                        None => return fail(&format!("--pool {s:?}: expected split, binned, none, arena or all")),
                    },
                    None => return fail("--pool needs a value"),
                }
            }
            "--device-size" => {
                i += 1;
                match args.get(i).and_then(|s| parse_size(s)) {
                    Some(n) if n > 0 => device_size = n,
                    _ => return fail("--device-size needs a size such as 80GiB"),
                }
            }
            "--decay" => {
                i += 1;
                match args.get(i).map(String::as_str) {
                    Some("off") => decay_window = 0,
                    Some(s) => match s.parse() {
                        Ok(n) => decay_window = n,
                        Err(_) => return fail(&format!("--decay {s:?}: expected a number of allocations or off")),
                    },
                    None => return fail("--decay needs a value"),
                }
            }
            "--upstream" => {
                i += 1;
                match args.get(i).map(String::as_str) {
                    Some("device") => paged = false,
                    Some("vmm") => paged = true,
                    _ => return fail("--upstream needs device or vmm"),
                }
            }
            "--no-arena-lend" => arena_lend = false,
            "--arena-piece-ends" => arena_piece_ends = true,
            "--arena-chunk" => {
                i += 1;
                match args.get(i).and_then(|s| parse_size(s)) {
                    Some(n) => arena_chunk = n,
                    None => return fail("--arena-chunk needs a size such as 256MiB (0: granule by granule)"),
                }
            }
            "--arena-chunk-from" => {
                i += 1;
                match args.get(i).and_then(|s| parse_size(s)) {
                    Some(n) => arena_chunk_from = n,
                    None => return fail("--arena-chunk-from needs a size such as 64MiB"),
                }
            }
            "--steps" => {
                i += 1;
                match args.get(i).map(|s| (s, Steps::parse(s))) {
                    Some((_, Some(st))) => steps = Some(st),
                    Some((s, None)) => return fail(&format!("--steps {s:?}: expected FIRST,EVERY,WARMUP event counts, EVERY above 0")),
                    None => return fail("--steps needs FIRST,EVERY,WARMUP"),
                }
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            p if path.is_none() => path = Some(p.to_string()),
            other => return fail(&format!("unexpected argument {other:?}")),
        }
        i += 1;
    }
    let Some(path) = path else { return fail("no trace file given") };
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) => return fail(&format!("cannot read {path}: {e}")),
    };
    let ops = match parse(&text) {
        Ok(o) => o,
        Err(e) => return fail(&format!("{path}: {e}")),
    };
    println!("{path}: {} alloc/free events, simulated device of {}", ops.len(), human_bytes(device_size));
    let decay = if decay_window == 0 { "off".to_string() } else { format!("{decay_window} allocations") };
    let upstream = if paged { "vmm (pages inside segments can go back)" } else { "device (whole segments only)" };
    println!("cache decay window: {decay}; simulated upstream: {upstream}");
    println!("| strategy | peak reserved | peak in use | peak reserved / peak in use | reserved/in use at peak | reserved/requested at end | OOMs | upstream allocs / frees | page runs committed / decommitted | bytes obtained: segments + pages | driver calls: all / second half | ns per op |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    // Progress on a terminal only (stderr), so a redirected table stays clean.
    let tty = std::io::stderr().is_terminal();
    let mut results: Vec<Report> = Vec::new();
    for k in pools {
        let opts = PoolOptions { kind: k, decay_window, arena_lend, arena_chunk, arena_chunk_from, arena_piece_ends, ..Default::default() };
        let mut progress = |done: usize, total: usize| {
            if tty {
                let _ = write!(std::io::stderr(), "\r  replaying through {:<7} {:>5.1}% of {total} events", k.name(), 100.0 * done as f64 / total.max(1) as f64);
                if done == total {
                    let _ = write!(std::io::stderr(), "\r{:<70}\r", "");
                }
            }
        };
        match replay_with_progress(&ops, &opts, device_size, paged, steps, &mut progress) {
            Ok(r) => {
                println!(
                "| {} | {} | {} | {:.3} | {:.3} | {:.3} | {} | {} / {} | {} / {} | {} + {} | {} / {} | {:.0} |",
                r.strategy,
                human_bytes(r.peak_reserved),
                human_bytes(r.peak_used),
                r.peak_reserved as f64 / r.peak_used.max(1) as f64,
                r.reserved_over_used_at_peak,
                r.end_reserved as f64 / r.end_requested.max(1) as f64,
                r.ooms,
                r.upstream_allocs,
                r.upstream_frees,
                r.commits,
                r.decommits,
                human_bytes(r.segment_bytes as usize),
                human_bytes(r.commit_bytes as usize),
                r.driver_calls,
                r.driver_calls_second_half,
                r.ns_per_op
                );
                results.push(r);
            }
            Err(e) => return fail(&e.to_string()),
        }
    }
    // The short summary: which strategy held least at the peak, and which settled.
    // (`none` caches nothing: the floor, not a choice.)
    if let Some(best) = results.iter().filter(|r| r.ooms == 0 && r.strategy != "none").min_by_key(|r| r.peak_reserved) {
        println!(
            "\nsummary: the caching strategy holding least at the peak: {} ({} reserved for {} in use, {:.3}x)",
            best.strategy,
            human_bytes(best.peak_reserved),
            human_bytes(best.peak_used),
            best.reserved_over_used_at_peak
        );
    }
    let settled: Vec<&str> = results.iter().filter(|r| r.driver_calls_second_half == 0).map(|r| r.strategy).collect();
    println!(
        "no driver call in the trace's second half: {}",
        if settled.is_empty() { "none".to_string() } else { settled.join(", ") }
    );
    let kinds: Vec<String> = results.iter().filter(|r| r.driver_calls_second_half > 0).map(|r| format!("{}: {}", r.strategy, r.second_half_by_kind)).collect();
    if !kinds.is_empty() {
        println!("the second half's driver calls by kind: {}", kinds.join("; "));
    }
    if steps.is_some() {
        for r in &results {
            let (all, off, peaks, peak_calls) = second_half_off_peak(&r.steps);
            let each: Vec<String> = r.steps.iter().map(|s| format!("{}{}", s.calls, if s.new_peak { "*" } else { "" })).collect();
            println!(
                "{} steps: {} measured; second half {all:.2} driver calls a step, {off:.2} off peak ({peaks} new-peak steps made {peak_calls}); each step (* new peak): {}",
                r.strategy,
                r.steps.len(),
                each.join(" ")
            );
        }
    }
    ExitCode::SUCCESS
}

fn fail(msg: &str) -> ExitCode {
    eprintln!("gpupool-replay: {msg}\n{USAGE}");
    ExitCode::from(2)
}
