//! The arena on the host upstream's simulated VMM (memfd-backed granules; unmapped address
//! space is PROT_NONE, so a block handed out over an unmapped granule crashes the test).
//! What it must show: memory held stays near the live peak however the free space is
//! scattered, a repeated step makes no driver call, pressure gives whole granules back,
//! and a device without VMM falls back to `split` with a notice.

#[macro_use]
mod common;

use common::*;
use gpupool::config::PoolKind;
use gpupool::error::{Error, Result};
use gpupool::stream::StreamHandle;
use gpupool::upstream::host::HostUpstream;
use gpupool::upstream::{AllocError, Upstream};
use gpupool::{Pool, PoolOptions};

const G: usize = 2 * MIB;

/// One step of a fragmenting program: mixed sizes, free every other block, then ask for
/// one block larger than any free hole, then free everything.
fn fragmenting_step(p: &mut Pool, step: usize) {
    let sizes = [11 * MIB + 4096, 700 * 1024, 13 * MIB, 96 * 1024, 17 * MIB + 512, 24 * MIB];
    let mut live = Vec::new();
    for i in 0..36 {
        let size = sizes[(i + step) % sizes.len()];
        let a = p.malloc(size, 0).unwrap();
        stamp(a, size, i as u64);
        live.push((a, size, i as u64));
    }
    let mut kept = Vec::new();
    for (i, b) in live.into_iter().enumerate() {
        if i % 2 == 0 {
            assert!(intact(b.0, b.1, b.2));
            p.free(b.0, 0).unwrap();
        } else {
            kept.push(b);
        }
    }
    let big = p.malloc(160 * MIB, 0).unwrap();
    stamp(big, 160 * MIB, 1000);
    for (a, s, id) in &kept {
        assert!(intact(*a, *s, *id), "a live block changed while granules moved");
    }
    assert!(intact(big, 160 * MIB, 1000));
    p.free(big, 0).unwrap();
    for (a, _, _) in kept {
        p.free(a, 0).unwrap();
    }
}

fn pool(kind: PoolKind, capacity: usize) -> Pool {
    let opts = PoolOptions { kind, check_invariants: true, thread_cache: false, ..Default::default() };
    Pool::new(0, Box::new(HostUpstream::new(capacity)), &opts).unwrap()
}

#[test]
fn fragmenting_pattern_holds_about_the_live_peak_and_repeats_without_driver_calls() {
    let mut arena = pool(PoolKind::Arena, 4 << 30);
    let mut split = pool(PoolKind::Split, 4 << 30);
    for step in 0..3 {
        fragmenting_step(&mut arena, step);
        fragmenting_step(&mut split, step);
    }
    let (a, s) = (arena.stats(), split.stats());
    let ratio = |st: &gpupool::Stats| st.peak_total_bytes as f64 / st.peak_used_bytes as f64;
    println!("peak reserved / peak in use: arena {:.3}, split {:.3}; {}", ratio(&a), ratio(&s), arena.memory_status());
    // What the arena cannot move is the partial granules at the edges of the freed blocks
    // (at most 2 MiB each side of each): under 5% here.
    assert!(ratio(&a) <= 1.05, "arena holds {:.3}x the live peak", ratio(&a));
    assert!(ratio(&s) > ratio(&a) + 0.2, "the pattern must fragment split ({:.3})", ratio(&s));
    assert!(arena.arena_counters().unwrap().stitches_made > 0, "the big block was stitched");
    // The steps once more. The first pass began with nothing mapped, so its small blocks
    // took scraps of the large range (`ArenaStrategy::take_spilled`); this one finds the
    // small range mapped and lays them out there, which moves free space once and may
    // cost one more stitch. From then on the layout repeats exactly.
    for step in 0..3 {
        fragmenting_step(&mut arena, step);
    }
    // The same steps again: everything they need is mapped where it was.
    let before = arena.driver_calls();
    fragmenting_step(&mut arena, 0);
    fragmenting_step(&mut arena, 1);
    fragmenting_step(&mut arena, 2);
    let after = arena.driver_calls();
    assert_eq!(after, before, "a repeated step called the upstream: {}", after.text());
}

#[test]
fn a_stitch_maps_each_granule_once_and_grants_access_once() {
    // Four 2-granule blocks, every other one freed: 4 free granules in two runs. A request
    // for 4 granules is stitched from them: 4 aliases and one access grant over the stitch
    // (a grant covers a range of separate mappings), not one grant per granule.
    let mut p = pool(PoolKind::Arena, 1 << 30);
    let blocks: Vec<usize> = (0..4).map(|_| p.malloc(2 * G, 0).unwrap()).collect();
    p.free(blocks[0], 0).unwrap();
    p.free(blocks[2], 0).unwrap();
    let before = p.driver_calls();
    let big = p.malloc(4 * G, 0).unwrap();
    let after = p.driver_calls();
    assert_eq!(p.arena_counters().unwrap().stitches_made, 1, "served by a stitch");
    assert_eq!(p.stats().total_bytes as usize, 8 * G, "no new memory");
    assert_eq!(after.mem_map - before.mem_map, 4, "one alias per granule: {}", after.text());
    assert_eq!(after.set_access - before.set_access, 1, "one access grant for the stitch: {}", after.text());
    stamp(big, 4 * G, 7);
    assert!(intact(big, 4 * G, 7));
    for b in [big, blocks[1], blocks[3]] {
        p.free(b, 0).unwrap();
    }
}

#[test]
fn a_small_request_takes_the_large_ranges_scraps_before_new_memory() {
    // A 3 MiB block maps 2 granules and leaves 1 MiB free in the second: a scrap no large
    // request or loan can use. A 512 KiB request takes it instead of mapping a granule of
    // the small range.
    let mut p = pool(PoolKind::Arena, 1 << 30);
    let big = p.malloc(3 * MIB, 0).unwrap();
    stamp(big, 3 * MIB, 1);
    let small = p.malloc(512 * 1024, 0).unwrap();
    stamp(small, 512 * 1024, 2);
    assert_eq!(p.stats().total_bytes as usize, 2 * G, "no new granule: {}", p.memory_status());
    assert!(small >= big + 3 * MIB && small < big + 2 * G, "served from the scrap after the big block");
    assert!(intact(big, 3 * MIB, 1) && intact(small, 512 * 1024, 2));
    // A second one does not fit the rest of the scrap (512 KiB left, 768 KiB asked): the
    // small range maps its own granule.
    let third = p.malloc(768 * 1024, 0).unwrap();
    assert_eq!(p.stats().total_bytes as usize, 3 * G);
    for b in [small, big, third] {
        p.free(b, 0).unwrap();
    }
    // Everything coalesces back: the large range's two granules are whole and free again.
    let again = p.malloc(4 * MIB, 0).unwrap();
    assert_eq!(again, big, "the scrap went back to its range");
    p.free(again, 0).unwrap();
}

#[test]
fn reported_memory_is_what_the_upstream_has_mapped() {
    let mut p = pool(PoolKind::Arena, 1 << 30);
    let a = p.malloc(6 * MIB, 0).unwrap();
    let b = p.malloc(100, 0).unwrap();
    let st = p.stats();
    // 6 MiB -> 3 granules, no scrap left; 100 B -> one granule of the small range.
    assert_eq!(st.total_bytes as usize, 4 * G);
    assert_eq!(st.device_total_bytes - st.device_free_bytes, st.total_bytes, "the upstream agrees");
    let json = p.stats_json();
    for key in ["\"arena\":{", "\"mapped_bytes\":8388608", "\"driver_calls\":{", "\"mem_create\":4", "\"total\":"] {
        assert!(json.contains(key), "{key} missing: {json}");
    }
    let text = p.memory_status();
    assert!(text.contains("Arena: 8.00 MiB mapped in 4 granules") && text.contains("Driver calls:"), "{text}");
    p.free(a, 0).unwrap();
    p.free(b, 0).unwrap();
}

#[test]
fn pressure_gives_whole_granules_back_and_the_limit_holds() {
    let mut p = pool(PoolKind::Arena, 1 << 30);
    let keep = p.malloc(3 * MIB, 0).unwrap(); // granules 0-1, ends mid-granule 1
    let gone = p.malloc(20 * MIB, 0).unwrap();
    p.free(gone, 0).unwrap();
    assert_eq!(p.stats().total_bytes as usize, 12 * G);
    let released = p.reclaim().unwrap();
    // The granule shared with the live block stays.
    assert_eq!(released, 10 * G);
    assert_eq!(p.stats().total_bytes as usize, 2 * G);
    p.set_limit(8 * MIB).unwrap();
    let e = p.malloc(8 * MIB, 0).unwrap_err();
    assert!(matches!(e, Error::OutOfMemory(ref r) if r.by_limit), "{e}");
    let ok = p.malloc(5 * MIB, 0).unwrap();
    assert!(p.stats().total_bytes as usize <= 8 * MIB);
    p.free(ok, 0).unwrap();
    // A limit below what is held releases the free granules at once.
    p.set_limit(4 * MIB).unwrap();
    assert_eq!(p.stats().total_bytes as usize, 2 * G);
    p.free(keep, 0).unwrap();
    p.set_limit(0).unwrap();
    p.reclaim().unwrap();
    assert_eq!(p.stats().total_bytes, 0);
}

#[test]
fn device_out_of_memory_moves_free_granules_instead_of_failing() {
    // 32 MiB device: 16 granules. Fill it, free every other 2-granule block, ask for 16 MiB.
    let mut p = pool(PoolKind::Arena, 32 * MIB);
    let blocks: Vec<usize> = (0..8).map(|_| p.malloc(4 * MIB, 0).unwrap()).collect();
    assert!(p.malloc(4 * MIB, 0).is_err(), "device full");
    for a in blocks.iter().step_by(2) {
        p.free(*a, 0).unwrap();
    }
    let big = p.malloc(16 * MIB, 0).expect("16 MiB free, in pieces: moved together");
    assert_eq!(p.stats().total_bytes as usize, 32 * MIB);
    let e = p.malloc(MIB * 2, 0).unwrap_err();
    assert!(e.to_string().contains("out of memory"), "{e}");
    p.free(big, 0).unwrap();
}

/// An upstream with no virtual memory API (a device without VMM support).
struct NoVmm(HostUpstream);

impl Upstream for NoVmm {
    fn name(&self) -> &'static str {
        "no-vmm"
    }
    fn allocate(&mut self, size: usize, s: StreamHandle) -> std::result::Result<usize, AllocError> {
        self.0.allocate(size, s)
    }
    fn deallocate(&mut self, a: usize, size: usize, s: StreamHandle) -> Result<()> {
        self.0.deallocate(a, size, s)
    }
    fn mem_info(&mut self) -> Result<(usize, usize)> {
        self.0.mem_info()
    }
}

#[test]
fn without_vmm_the_arena_falls_back_to_split_with_a_notice() {
    let opts = PoolOptions { kind: PoolKind::Arena, check_invariants: true, ..Default::default() };
    let mut p = Pool::new(0, Box::new(NoVmm(HostUpstream::new(1 << 30))), &opts).unwrap();
    assert_eq!(p.strategy_name(), "split");
    assert!(p.notice().is_some_and(|n| n.contains("arena unavailable")));
    let status = p.memory_status();
    assert_eq!(status.lines().filter(|l| l.contains("Notice: arena unavailable")).count(), 1, "{status}");
    assert!(p.stats_json().contains("\"notice\":\"arena unavailable"));
    let a = p.malloc(MIB, 0).unwrap();
    p.free(a, 0).unwrap();
}

/// A long randomized run against a model of the live blocks: several streams, limits,
/// reclaims; the full invariant scan every 256 operations, every block's contents checked.
#[test]
fn long_randomized_run_matches_the_model() {
    let ops: usize = std::env::var("GPUPOOL_ARENA_MODEL_OPS").ok().and_then(|v| v.parse().ok()).unwrap_or(200_000);
    randomized_run(ops, 0);
}

/// The same with cache decay, which releases granules on its own between operations.
#[test]
fn long_randomized_run_with_decay_matches_the_model() {
    let ops: usize = std::env::var("GPUPOOL_ARENA_MODEL_OPS").ok().and_then(|v| v.parse().ok()).unwrap_or(200_000);
    randomized_run(ops / 2, 512);
}

#[test]
fn long_randomized_run_with_chunks_matches_the_model() {
    // Blocks up to 200 MiB: growths long enough to be mapped in chunks, stitched, lent
    // around and released whole, under limits and reclaims.
    randomized_run_of(20_000, 0, 1 << 30, 200 * MIB);
}

fn randomized_run(ops: usize, decay_window: usize) {
    randomized_run_of(ops, decay_window, 256 * MIB, 40 * MIB)
}

fn randomized_run_of(ops: usize, decay_window: usize, capacity: usize, largest: usize) {
    let opts = PoolOptions { kind: PoolKind::Arena, check_invariants: false, decay_window, ..Default::default() };
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
                        // A chunk (a growth of 64 MiB or more maps chunks of half of it)
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
}

#[test]
fn each_range_grows_into_the_others_free_granules_before_mapping_new_memory() {
    let pool = |kind, capacity| {
        let opts = PoolOptions { kind, check_invariants: true, thread_cache: false, arena_lend: true, ..Default::default() };
        Pool::new(0, Box::new(HostUpstream::new(capacity)), &opts).unwrap()
    };
    // Large blocks come and go, then small ones need room: the small range shows the large
    // range's free granules (an alias each) instead of mapping new memory; the data stays
    // apart, and reclaim gives everything back.
    let mut p = pool(PoolKind::Arena, 1 << 30);
    let big = p.malloc(8 * MIB, 0).unwrap();
    p.free(big, 0).unwrap();
    assert_eq!(p.stats().total_bytes as usize, 8 * MIB);
    let small: Vec<(usize, u64)> = (0..12).map(|i| (p.malloc(512 * 1024, 0).unwrap(), i)).collect();
    for &(a, i) in &small {
        stamp(a, 512 * 1024, i);
    }
    assert_eq!(p.stats().total_bytes as usize, 8 * MIB, "6 MiB of small blocks took no new memory");
    assert_eq!(p.arena_counters().unwrap().granules_lent, 3);
    let large = p.malloc(2 * MIB, 0).unwrap(); // the large range's last free granule
    stamp(large, 2 * MIB, 100);
    for &(a, i) in &small {
        assert!(intact(a, 512 * 1024, i), "a small block changed");
    }
    assert!(intact(large, 2 * MIB, 100), "the large block changed");
    for &(a, _) in &small {
        p.free(a, 0).unwrap();
    }
    p.free(large, 0).unwrap();
    p.reclaim().unwrap();
    assert_eq!(p.stats().total_bytes, 0, "loans ended and their homes went back");
    let c = p.arena_counters().unwrap();
    assert_eq!(c.loans_ended, c.granules_lent);
    p.check_invariants().unwrap();

    // The reverse: small blocks come and go, then a large one takes their granule.
    let mut p = pool(PoolKind::Arena, 1 << 30);
    let small: Vec<usize> = (0..4).map(|_| p.malloc(512 * 1024, 0).unwrap()).collect();
    let keep = p.malloc(512 * 1024, 0).unwrap();
    stamp(keep, 512 * 1024, 7);
    for a in small {
        p.free(a, 0).unwrap();
    }
    assert_eq!(p.stats().total_bytes as usize, 4 * MIB);
    let large = p.malloc(2 * MIB, 0).unwrap();
    stamp(large, 2 * MIB, 8);
    assert_eq!(p.stats().total_bytes as usize, 4 * MIB, "the large range grew into the small range's free granule");
    assert!(intact(keep, 512 * 1024, 7) && intact(large, 2 * MIB, 8));
    p.free(large, 0).unwrap();
    p.free(keep, 0).unwrap();
    p.reclaim().unwrap();
    assert_eq!(p.stats().total_bytes, 0);
    p.check_invariants().unwrap();
}

/// The host upstream, where the next alias run fails after its mappings are made (a refused
/// access grant) and the next `unalias_failures` alias removals fail too.
struct StickyAliases {
    host: HostUpstream,
    fail_next_alias: std::sync::Arc<std::sync::atomic::AtomicBool>,
    unalias_failures: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Upstream for StickyAliases {
    fn name(&self) -> &'static str {
        "sticky-aliases"
    }
    host_memory!();
    host_address_space!();
    fn vmm_map_new(&mut self, addr: usize, len: usize) -> std::result::Result<(), AllocError> {
        self.host.vmm_map_new(addr, len)
    }
    fn vmm_unmap(&mut self, addr: usize, len: usize) -> std::result::Result<(), gpupool::upstream::UnmapFail> {
        self.host.vmm_unmap(addr, len)
    }
    fn vmm_alias(&mut self, homes: &[usize], to: usize) -> std::result::Result<(), gpupool::upstream::AliasFail> {
        self.host.vmm_alias(homes, to)?;
        if self.fail_next_alias.swap(false, std::sync::atomic::Ordering::SeqCst) {
            let error = Error::Internal("injected: access grant refused".into());
            return Err(gpupool::upstream::AliasFail { made: homes.len(), error });
        }
        Ok(())
    }
    fn vmm_unalias(&mut self, addr: usize, len: usize) -> Result<()> {
        let left = &self.unalias_failures;
        if left.load(std::sync::atomic::Ordering::SeqCst) > 0 {
            left.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
            return Err(Error::Internal("injected: unmap refused".into()));
        }
        self.host.vmm_unalias(addr, len)
    }
    fn driver_calls(&self) -> gpupool::upstream::DriverCalls {
        self.host.driver_calls()
    }
}

#[test]
fn a_loan_whose_alias_cannot_be_removed_is_quarantined_and_retried() {
    use std::sync::atomic::{AtomicBool, AtomicUsize};
    use std::sync::Arc;
    let (fail, unalias) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)));
    let up = StickyAliases { host: HostUpstream::new(1 << 30), fail_next_alias: fail.clone(), unalias_failures: unalias.clone() };
    let opts = PoolOptions { kind: PoolKind::Arena, check_invariants: true, thread_cache: false, arena_lend: true, ..Default::default() };
    let mut p = Pool::new(0, Box::new(up), &opts).unwrap();
    // Four free granules in the large range for the small range to borrow.
    let big = p.malloc(8 * MIB, 0).unwrap();
    p.free(big, 0).unwrap();
    // The loan's access grant fails and so does removing its alias: the request fails with
    // the driver's error and the granule is quarantined (booked, not handed out).
    fail.store(true, std::sync::atomic::Ordering::SeqCst);
    unalias.store(1, std::sync::atomic::Ordering::SeqCst);
    let e = p.malloc(512 * 1024, 0).unwrap_err();
    assert!(e.to_string().contains("access grant refused"), "{e}");
    p.check_invariants().unwrap();
    // The next request plans around it (before the fix it tried to map new memory over the
    // stale alias and failed with the driver's error every time).
    let small: Vec<usize> = (0..8).map(|_| p.malloc(512 * 1024, 0).unwrap()).collect();
    for (i, &a) in small.iter().enumerate() {
        stamp(a, 512 * 1024, i as u64);
    }
    for (i, &a) in small.iter().enumerate() {
        assert!(intact(a, 512 * 1024, i as u64));
        p.free(a, 0).unwrap();
    }
    // Reclaim removes the stale alias and gives everything back.
    p.reclaim().unwrap();
    assert_eq!(p.stats().total_bytes, 0, "{}", p.memory_status());
    p.check_invariants().unwrap();
    let again = p.malloc(512 * 1024, 0).unwrap();
    p.free(again, 0).unwrap();
}

#[test]
fn a_long_growth_is_mapped_in_chunks_which_are_stitched_and_released_whole() {
    let mut p = pool(PoolKind::Arena, 2 << 30);
    // 256 MiB of new memory: two chunks of 128 MiB (half the run), one create + one map
    // each and one access grant per chunk, not 128 of each.
    let before = p.driver_calls();
    let a1 = p.malloc(256 * MIB, 0).unwrap();
    let d = p.driver_calls();
    assert_eq!((d.mem_create - before.mem_create, d.mem_map - before.mem_map), (2, 2), "{}", d.text());
    let b = p.malloc(2 * MIB, 0).unwrap(); // a granule between the two big blocks
    let a2 = p.malloc(256 * MIB, 0).unwrap();
    let c = p.malloc(2 * MIB, 0).unwrap();
    p.free(a1, 0).unwrap();
    p.free(a2, 0).unwrap();
    // 400 MiB: no free run is that long, two of 256 MiB are free. The stitch shows the four
    // chunks whole (one alias each, one grant), no new memory.
    let mapped = p.stats().total_bytes;
    let before = p.driver_calls();
    let big = p.malloc(400 * MIB, 0).unwrap();
    let d = p.driver_calls();
    assert_eq!(p.stats().total_bytes, mapped, "no new memory");
    assert_eq!(p.arena_counters().unwrap().stitches_made, 1);
    assert_eq!((d.mem_map - before.mem_map, d.set_access - before.set_access), (4, 1), "one alias per chunk: {}", d.text());
    stamp(big, 400 * MIB, 9);
    stamp(b, 2 * MIB, 10);
    assert!(intact(big, 400 * MIB, 9) && intact(b, 2 * MIB, 10));
    p.check_invariants().unwrap();
    for x in [big, b, c] {
        p.free(x, 0).unwrap();
    }
    // Released whole: one unmap + release per chunk and per granule (and one unmap per
    // alias mapping of the stitch over them).
    let before = p.driver_calls();
    p.reclaim().unwrap();
    let d = p.driver_calls();
    assert_eq!(p.stats().total_bytes, 0);
    assert_eq!(d.mem_release - before.mem_release, 6, "4 chunks + 2 granules: {}", d.text());
    assert_eq!(d.mem_unmap - before.mem_unmap, 6 + 4, "and the stitch's 4 alias mappings: {}", d.text());
    p.check_invariants().unwrap();
}

#[test]
fn a_block_in_a_chunk_exports_the_whole_chunk_and_is_refused_where_others_live_in_it() {
    let mut p = pool(PoolKind::Arena, 2 << 30);
    let a = p.malloc(256 * MIB, 0).unwrap(); // two chunks of 128 MiB
    p.free(a, 0).unwrap();
    let x = p.malloc(4 * MIB, 0).unwrap(); // carved at the first chunk's start
    let y = p.malloc(4 * MIB, 0).unwrap();
    assert!(x == a && y > x && y < a + 128 * MIB, "both carved from the first chunk");
    let granules = 128 * MIB / G;
    let len = p.ipc_export_len(x).unwrap();
    assert_eq!(len, gpupool::upstream::shared::HEADER_BYTES + granules * gpupool::upstream::shared::GRANULE_BYTES, "the whole chunk is listed");
    // The importer maps the chunk whole and would see `y` too: a strict export is refused,
    // one that shares granules goes.
    let e = p.ipc_export(x, false).unwrap_err().to_string();
    assert!(e.contains("shares its"), "{e}");
    assert!(p.ipc_export(x, true).is_ok());
    // `y` starts past the chunk's first granule: its descriptor says so, and an importer
    // maps the chunk and finds `y` at that offset.
    stamp(y, 4 * MIB, 4);
    let dy = gpupool::upstream::shared::Descriptor::decode(&p.ipc_export(y, true).unwrap()).unwrap();
    assert_eq!((dy.offset as usize, dy.granules.len()), (y - a, granules));
    let fds: Vec<i32> = dy.granules.iter().map(|s| s.fd).collect();
    let at = p.ipc_import(&dy, Some(&fds)).unwrap();
    assert!(intact(at, 4 * MIB, 4), "the import shows y's bytes");
    p.ipc_close(at).unwrap();
    p.free(y, 0).unwrap();
    stamp(x, 4 * MIB, 3);
    let desc = p.ipc_export(x, false).unwrap();
    let d = gpupool::upstream::shared::Descriptor::decode(&desc).unwrap();
    assert_eq!((d.granules.len(), d.offset), (granules, 0));
    // The rest of the chunk is set aside while `x` lives: a new block goes elsewhere.
    let z = p.malloc(4 * MIB, 0).unwrap();
    assert!(z >= a + 128 * MIB, "not in the exported chunk");
    // The importer maps the chunk and sees the block's bytes.
    let fds: Vec<i32> = d.granules.iter().map(|s| s.fd).collect();
    let at = p.ipc_import(&d, Some(&fds)).unwrap();
    assert!(intact(at, 4 * MIB, 3), "the import shows the exported bytes");
    p.ipc_close(at).unwrap();
    for b in [x, z] {
        p.free(b, 0).unwrap();
    }
    p.check_invariants().unwrap();
}

#[test]
fn chunks_off_maps_granule_by_granule() {
    let opts = PoolOptions { kind: PoolKind::Arena, check_invariants: true, thread_cache: false, arena_chunk: 0, ..Default::default() };
    let mut p = Pool::new(0, Box::new(HostUpstream::new(1 << 30)), &opts).unwrap();
    let before = p.driver_calls();
    let a = p.malloc(128 * MIB, 0).unwrap();
    assert_eq!(p.driver_calls().mem_create - before.mem_create, 64);
    p.free(a, 0).unwrap();
}

#[test]
fn no_chunk_is_larger_than_the_largest_and_near_the_devices_memory_growth_maps_granules() {
    // 600 MiB: chunks of 256 MiB at most (256 + 172 + 172), not a 344 MiB tail.
    let mut p = pool(PoolKind::Arena, 4 << 30);
    let before = p.driver_calls();
    let a = p.malloc(600 * MIB, 0).unwrap();
    assert_eq!(p.driver_calls().mem_create - before.mem_create, 3, "{}", p.driver_calls().text());
    p.free(a, 0).unwrap();
    // A 768 MiB device: 512 MiB is over half of it, so it maps granules. Two 2 MiB blocks
    // then sit in what would have been two chunks, and a 700 MiB request still finds the
    // 508 MiB free around them (a partly used chunk could give none of it).
    let mut p = pool(PoolKind::Arena, 768 * MIB);
    let big = p.malloc(512 * MIB, 0).unwrap();
    p.free(big, 0).unwrap();
    let a = p.malloc(2 * MIB, 0).unwrap();
    let filler = p.malloc(254 * MIB, 0).unwrap();
    let b = p.malloc(2 * MIB, 0).unwrap();
    p.free(filler, 0).unwrap();
    let x = p.malloc(700 * MIB, 0).unwrap_or_else(|e| panic!("{e}\n{}", p.memory_status()));
    stamp(x, 700 * MIB, 5);
    assert!(intact(x, 700 * MIB, 5));
    for blk in [x, a, b] {
        p.free(blk, 0).unwrap();
    }
    p.check_invariants().unwrap();
}
