//! The arena's long randomized runs against a model of the live blocks, on the host
//! upstream's simulated VMM: several streams, limits, reclaims, cache decay, and blocks long
//! enough to be mapped in chunks; no block handed out twice, every block's contents intact,
//! an out-of-memory error only where the cap leaves no room, and everything back at the end.
//! `GPUPOOL_ARENA_MODEL_OPS` sets the length of the runs of small blocks (at least 2,000).

mod common;
mod arena_support;

use arena_support::G;
use common::{intact, stamp, MIB};
use gpupool::config::PoolKind;
use gpupool::error::Error;
use gpupool::stream::StreamHandle;
use gpupool::upstream::host::HostUpstream;
use gpupool::{Pool, PoolOptions};

/// A long randomized run against a model of the live blocks: several streams, limits,
/// reclaims; the full invariant scan every 256 operations, every block's contents checked.
#[test]
fn long_randomized_run_matches_the_model() {
    let ops = model_ops();
    randomized_run(ops, 0);
}

/// The same with cache decay, which releases granules on its own between operations.
#[test]
fn long_randomized_run_with_decay_matches_the_model() {
    let ops = model_ops();
    randomized_run(ops / 2, 512);
}

#[test]
fn long_randomized_run_with_chunks_matches_the_model() {
    // Blocks up to 200 MiB: growths long enough to be mapped in chunks, stitched, lent
    // around and released whole, under limits and reclaims.
    randomized_run_of(20_000, 0, 1 << 30, 200 * MIB, false);
}

/// With stitches that begin and end in pieces of granules other blocks hold the rest of
/// (`GPUPOOL_ARENA_PIECE_ENDS`): every block's contents stay intact beside them.
#[test]
fn long_randomized_run_with_piece_ends_matches_the_model() {
    let ops = model_ops();
    randomized_run_of(ops, 0, 256 * MIB, 40 * MIB, true);
    randomized_run_of(20_000, 0, 1 << 30, 200 * MIB, true);
}

/// `GPUPOOL_ARENA_MODEL_OPS` (default 200,000), and never fewer than 2,000: a shorter run
/// would reach no stitch, loan or release, and pass on nothing.
fn model_ops() -> usize {
    std::env::var("GPUPOOL_ARENA_MODEL_OPS").ok().and_then(|v| v.parse().ok()).unwrap_or(200_000).max(2_000)
}

fn randomized_run(ops: usize, decay_window: usize) {
    randomized_run_of(ops, decay_window, 256 * MIB, 40 * MIB, false)
}

fn randomized_run_of(ops: usize, decay_window: usize, capacity: usize, largest: usize, arena_piece_ends: bool) {
    let opts = PoolOptions { kind: PoolKind::Arena, check_invariants: false, decay_window, arena_piece_ends, ..Default::default() };
    let mut p = Pool::new(0, Box::new(HostUpstream::new(capacity)), &opts).unwrap();
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut live: Vec<(usize, usize, u64, StreamHandle)> = Vec::new();
    let mut limit = 0usize;
    for id in 0..ops as u64 {
        let r = next();
        let stream: StreamHandle = [0usize, 0, 0xA00, 0xB00][(r % 4) as usize];
        match r % 100 {
            0..=49 => {
                let size = match (r >> 8) % 10 {
                    0..=4 => 1 + (r >> 16) as usize % (64 * 1024),
                    5..=7 => 1 + (r >> 16) as usize % (4 * MIB),
                    _ => 1 + (r >> 16) as usize % largest,
                };
                match p.malloc(size, stream) {
                    Ok(a) => {
                        assert!(!live.iter().any(|l| l.0 == a), "op {id}: {a:#x} handed out twice");
                        stamp(a, size, id);
                        live.push((a, size, id, stream));
                    }
                    Err(Error::OutOfMemory(rep)) => {
                        // Legitimate only when live memory plus the request in granules (one
                        // more for a window's unaligned edges), plus what cannot move (the
                        // partial granules at the edges of each gap between live blocks),
                        // passes the cap.
                        let cap = if limit == 0 { capacity } else { limit.min(capacity) };
                        let need = rep.rounded.div_ceil(G) * G + G;
                        // A chunk (a growth of 64 MiB or more maps chunks of at most half of it)
                        // partly in use strands the rest of it as well.
                        let chunk = if largest >= 64 * MIB { largest / 2 } else { 0 };
                        let stranded = (live.len() + 1) * (2 * G + chunk);
                        assert!(rep.in_use + need + stranded > cap, "spurious OOM at op {id}: {rep:?}");
                    }
                    Err(e) => panic!("unexpected error {e}"),
                }
            }
            50..=93 if !live.is_empty() => {
                let (a, s, i, st) = live.swap_remove((r >> 8) as usize % live.len());
                assert!(intact(a, s, i), "block {a:#x} overwritten");
                let free_on = if r % 7 == 0 { 0xC00 } else { st };
                p.free(a, free_on).unwrap();
            }
            94..=96 => {
                let before = p.stats().total_bytes;
                let n = p.reclaim().unwrap();
                assert_eq!(p.stats().total_bytes, before - n as u64);
            }
            97..=98 => {
                limit = if r % 3 == 0 { 0 } else { (64 + (r >> 8) as usize % 160) * MIB * (capacity / (256 * MIB)) };
                p.set_limit(limit).unwrap();
            }
            _ => {
                if let Some(&(a, _, _, _)) = live.get((r >> 8) as usize % live.len().max(1)) {
                    p.record_stream(a, 0xD00).unwrap();
                }
            }
        }
        if id % 256 == 0 || std::env::var_os("ARENA_DBG").is_some() {
            p.check_invariants().unwrap_or_else(|e| panic!("after op {id}: {e}"));
        }
        let st = p.stats();
        assert_eq!(st.n_live_blocks as usize, live.len());
        assert_eq!(st.used_bytes + st.free_bytes, st.total_bytes);
        assert!(st.total_bytes as usize <= capacity);
    }
    for (a, s, i, st) in live {
        assert!(intact(a, s, i));
        p.free(a, st).unwrap();
    }
    p.reclaim().unwrap();
    assert_eq!(p.stats().total_bytes, 0);
    p.check_invariants().unwrap();
    let counters = p.arena_figures().unwrap().counters;
    let pieces = counters.stitch_pieces;
    assert_eq!(pieces > 0, arena_piece_ends, "{pieces} stitch ends in pieces of granules");
    // The run reached what it is for: stitches made and granules released.
    assert!(counters.stitches_made > 0 && counters.granules_unmapped > 0, "{ops} operations made no stitch or release: {counters:?}");
}
