//! Faults, the long random runs: an upstream that fails driver calls on a schedule (every
//! Nth call of a kind, or a seeded random one), under every strategy. Every failure must come
//! back as a clear error, the pool's books must stay exact (its invariant scan runs after
//! every operation), no block may be handed out twice or lost, and once the faults stop
//! everything works and all memory goes back. The arena's virtual memory calls fail at random
//! points inside them (a granule's creation, map or access grant, an alias's map or grant, an
//! unmap, a release after a successful unmap, an alias's removal, the export of a granule's
//! shareable handle, an import's reservation, descriptor, map or access grant, an import's
//! unmap), and after every operation its books must agree with what the host upstream really
//! maps: nothing handed out unmapped, nothing mapped over memory still mapped, no reserved
//! range but the arena's and the imports' open now, and an export that failed leaves the
//! arena's books as they were. The segment pools (`split`, `binned`, `none`) run page-mapped
//! too, where the upstream's page commit fails as a whole and its page decommit fails at any
//! page (its unmap, or the release of its memory after the unmap), and after every operation
//! their books agree with what the host really backs: the bytes held, and no block handed out
//! over a decommitted page. `GPUPOOL_FAULT_OPS` sets the length of the runs. The upstream
//! and the checks are in `faults_support/`; each failure at each step, alone, is in
//! `faults_targeted.rs`.

#[macro_use]
mod common;
mod faults_support;

use common::{stamp, MIB};
use faults_support::*;
use gpupool::config::PoolKind;
use gpupool::error::Error;
use gpupool::stream::StreamHandle;
use gpupool::upstream::host::HostUpstream;
use gpupool::upstream::host::HOST_PAGE;
use gpupool::{Pool, PoolOptions};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

const STREAMS: [StreamHandle; 3] = [0, 0xA00, 0xB00];

/// What a churn did: faults injected, the virtual memory and page call failures by step,
/// and the page runs the pool committed and decommitted.
struct Churned {
    faults: u64,
    hits: BTreeMap<&'static str, u64>,
    page_ops: (u64, u64),
}

/// Random operations under `schedule` (`only`: only the calls of those kinds fail). On the
/// arena some operations export a live block and import it again, or close an import.
/// `pages`: the upstream is page-mapped, so segment pools decommit the pages inside free
/// blocks and commit them again, and cache decay is on.
fn churn(kind: PoolKind, every: u64, random: u64, seed: u64, ops: usize, only: &'static [&'static str], pages: bool) -> Churned {
    let s = Arc::new(Mutex::new(Schedule { every, random, rng: seed | 1, only, pages, ..Default::default() }));
    let up = FaultyUpstream { host: HostUpstream::new(256 * MIB), s: s.clone(), next_event: 0 };
    // Page-mapped, cache decay gives pages back during the run too, not only at reclaims.
    let decay_window = if pages { 64 } else { 0 };
    let opts = PoolOptions { kind, check_invariants: true, decay_window, ..Default::default() };
    let mut p = match Pool::new(0, Box::new(up), &opts) {
        Ok(p) => p,
        Err(e) => panic!("{kind:?}: pool creation failed without faults: {e}"),
    };
    let mut rng = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407) | 1;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    // Live blocks: (addr, size, stream, stamp id).
    let mut live: Vec<(usize, usize, StreamHandle, u64)> = Vec::new();
    let mut imports: Imports = Vec::new();
    for i in 0..ops {
        let r = next();
        let stream = STREAMS[(r >> 8) as usize % 3];
        match r % 10 {
            0..=4 => {
                let size = match (r >> 16) % 3 {
                    0 => 1 + (r >> 24) as usize % 4096,
                    1 => 4096 + (r >> 24) as usize % (2 * MIB),
                    // Now and then a block long enough for the arena to map chunks.
                    _ if kind == PoolKind::Arena && (r >> 40) % 16 == 0 => 64 * MIB + (r >> 24) as usize % (32 * MIB),
                    _ => 2 * MIB + (r >> 24) as usize % (12 * MIB),
                };
                match p.malloc(size, stream) {
                    Ok(a) => {
                        for &(b, n, _, _) in &live {
                            assert!(a + size <= b || b + n <= a, "{kind:?}: block {a:#x}+{size} handed out over live {b:#x}+{n}");
                        }
                        if kind == PoolKind::Arena {
                            let g = lock(&s);
                            let first = a & !(HOST_PAGE - 1);
                            if let Some(u) = (first..a + size).step_by(HOST_PAGE).find(|u| !g.real.contains(u)) {
                                panic!("operation {i}: block {a:#x}+{size} handed out over the unmapped granule {u:#x}");
                            }
                        } else if pages {
                            // A write into every page of the block below faults on a
                            // decommitted one; say which first.
                            let g = lock(&s);
                            let first = a & !(HOST_PAGE - 1);
                            if let Some(u) = (first..a + size).step_by(HOST_PAGE).find(|u| g.decommitted.contains(u)) {
                                panic!("{kind:?}, operation {i}: block {a:#x}+{size} handed out over the decommitted page {u:#x}");
                            }
                            drop(g);
                            touch_pages(a, size);
                        }
                        stamp(a, size, i as u64);
                        live.push((a, size, stream, i as u64));
                    }
                    Err(Error::OutOfMemory(_)) | Err(Error::Cuda { .. }) | Err(Error::Internal(_)) => {}
                    Err(e) => panic!("{kind:?}: unexpected error kind {e}"),
                }
            }
            5..=7 if !live.is_empty() => {
                let (a, n, st, id) = live.swap_remove((r >> 20) as usize % live.len());
                check(a, n, id);
                // The exporter keeps a block while others map it: its imports close first.
                while let Some(j) = imports.iter().position(|m| m.2 == a) {
                    close_import(&mut p, &mut imports, j);
                }
                match p.free(a, st) {
                    Ok(()) => {}
                    // A free that failed changed nothing: the block is still the caller's.
                    Err(e) => {
                        assert!(matches!(e, Error::Cuda { .. } | Error::Internal(_)), "{kind:?}: {e}");
                        live.push((a, n, st, id));
                    }
                }
            }
            8 if kind == PoolKind::Arena && (r >> 44) % 2 == 0 => {
                if !imports.is_empty() && (r >> 48) % 3 == 0 {
                    let j = (r >> 20) as usize % imports.len();
                    close_import(&mut p, &mut imports, j);
                } else {
                    // Blocks of a granule or more: smaller ones share their granule with
                    // other live blocks, and their export is refused.
                    let large: Vec<_> = live.iter().filter(|b| b.1 >= HOST_PAGE).map(|&(a, n, _, id)| (a, n, id)).collect();
                    if !large.is_empty() {
                        export_and_import(&mut p, &s, large[(r >> 20) as usize % large.len()], &mut imports, i);
                    } else if !live.is_empty() {
                        let (a, n, _, id) = live[(r >> 20) as usize % live.len()];
                        export_and_import(&mut p, &s, (a, n, id), &mut imports, i);
                    }
                }
            }
            8 if !live.is_empty() => {
                let (a, ..) = live[(r >> 20) as usize % live.len()];
                let _ = p.record_stream(a, STREAMS[(r >> 40) as usize % 3]);
            }
            9 => match (r >> 12) % 3 {
                0 => {
                    let _ = p.reclaim();
                }
                1 => {
                    let _ = p.set_limit(if (r >> 30) % 2 == 0 { 0 } else { 96 * MIB });
                }
                _ => {
                    let _ = p.set_limit(0);
                }
            },
            _ => {}
        }
        if kind == PoolKind::Arena {
            books_agree(&mut p, &s, i, &imports);
        } else if pages {
            pages_agree(&p, &s, kind, &format!("operation {i}"));
        }
    }
    // Faults stop: everything works and everything goes back.
    let (faults, leaks) = {
        let mut g = lock(&s);
        g.off = true;
        (g.injected, g.leaks)
    };
    p.set_limit(0).unwrap();
    while !imports.is_empty() {
        assert!(close_import(&mut p, &mut imports, 0), "{kind:?}: a close after the faults failed");
    }
    for (a, n, st, id) in live.drain(..) {
        check(a, n, id);
        p.free(a, st).unwrap_or_else(|e| panic!("{kind:?}: free after the faults failed: {e}"));
    }
    let x = p.malloc(64 * MIB, 0xA00).unwrap_or_else(|e| panic!("{kind:?}: allocation after the faults failed: {e}"));
    p.free(x, 0xA00).unwrap();
    p.reclaim().unwrap();
    p.check_invariants().unwrap();
    assert_eq!(p.used_bytes(), 0, "{kind:?}: bytes still counted in use");
    assert_eq!(p.reserved_bytes(), 0, "{kind:?}: memory lost: {} bytes still reserved after freeing all and reclaiming", p.reserved_bytes());
    if pages && kind != PoolKind::Arena {
        pages_agree(&p, &s, kind, "the end");
        assert!(lock(&s).decommitted.is_empty(), "{kind:?}: pages decommitted after every segment went back");
    }
    if kind == PoolKind::Arena {
        books_agree(&mut p, &s, ops, &imports);
        // Each granule whose release failed is reported as leaked, exactly.
        let leaked = p.arena_figures().unwrap().leaked;
        assert_eq!(leaked, leaks as usize * HOST_PAGE, "granules leaked: {leaks} injected, {leaked} bytes reported");
    }
    let hits = std::mem::take(&mut lock(&s).hits);
    Churned { faults, hits, page_ops: p.page_ops() }
}

const KINDS: [PoolKind; 4] = [PoolKind::Split, PoolKind::Binned, PoolKind::None, PoolKind::Arena];

/// Operations of the long runs, per strategy: `GPUPOOL_FAULT_OPS` (CI sets 400,000).
/// The shortest run (`GPUPOOL_FAULT_OPS`) in which `binned` must have failed at every step
/// of the page calls (at 100,000 a step is still missed for some seeds).
const BINNED_ALL_STEPS_FROM: usize = 400_000;

fn fault_ops() -> usize {
    std::env::var("GPUPOOL_FAULT_OPS").ok().and_then(|v| v.parse().ok()).unwrap_or(20_000)
}

#[test]
fn every_nth_call_failing_loses_nothing() {
    for kind in KINDS {
        let mut total = 0;
        for every in [2, 3, 7, 13] {
            total += churn(kind, every, 0, every, 4_000, &[], false).faults;
        }
        println!("{kind:?}: {total} faults injected (every 2nd/3rd/7th/13th call), survived");
        assert!(total > 100, "{kind:?}: the schedule injected almost nothing ({total})");
    }
}

#[test]
fn seeded_random_faults_lose_nothing() {
    let ops = fault_ops();
    for kind in KINDS {
        let mut total = 0;
        for seed in 1..=4u64 {
            total += churn(kind, 0, 5, seed * 7919, ops / 4, &[], false).faults;
        }
        println!("{kind:?}: {ops} operations, {total} random faults injected, survived");
        assert!(total > 50, "{kind:?}: {total}");
    }
}

/// Only the arena's virtual memory calls fail (at random steps inside them), often, so
/// failures land on every path that maps, aliases, unmaps, removes aliases, exports,
/// imports and closes imports; after every operation the books agree with what is mapped
/// and reserved (`churn`). `GPUPOOL_FAULT_OPS` operations (at least 20,000), in which
/// every step of every call (`STEPS`) must have failed at least once.
#[test]
fn arena_books_stay_exact_when_virtual_memory_calls_fail() {
    // Below 20,000 operations the imports' maps may escape failure.
    let ops = fault_ops().max(20_000);
    let mut total = 0;
    let mut hits: BTreeMap<&'static str, u64> = BTreeMap::new();
    for (seed, random) in [(11u64, 3u64), (13, 4), (17, 6), (19, 10)] {
        let c = churn(PoolKind::Arena, 0, random, seed * 7919, ops / 4, VMM_CALLS, false);
        total += c.faults;
        for (k, v) in c.hits {
            *hits.entry(k).or_default() += v;
        }
    }
    println!("Arena: {ops} operations, {total} virtual memory calls failed, books exact throughout; by step:");
    for step in STEPS {
        println!("  {step:<36} {}", hits.get(step).copied().unwrap_or(0));
    }
    let missed: Vec<&&str> = STEPS.iter().filter(|s| !hits.contains_key(**s)).collect();
    assert!(missed.is_empty(), "no failure was injected at {missed:?}");
    assert!(total > 100, "the schedule injected almost nothing ({total})");
}

/// The segment pools' churns, page-mapped with cache decay on: only the page calls fail
/// (often, at random pages inside them), then those and segment releases (a release that
/// fails leaves the cache over its cap, which `binned` answers with page decommits), then
/// every call. After every operation the books agree with what the host backs, no block is
/// handed out over a decommitted page, and once the faults stop all memory goes back
/// (`churn`). `GPUPOOL_FAULT_OPS / 2` operations a strategy (at least 4,000). `split` must
/// have had every step of the page calls (`PAGE_STEPS`) fail; `binned` decommits rarely (a
/// free block of it is a whole segment, released whole where it can be), so its every step
/// fails only in a long run: it is held to that at `BINNED_ALL_STEPS_FROM` operations or
/// more (`scripts/test.sh` runs 400,000). `none` caches nothing: it never commits or
/// decommits a page.
#[test]
fn segment_pool_books_stay_exact_when_page_calls_fail() {
    let ops = (fault_ops() / 2).max(4_000);
    let runs: [(u64, u64, &'static [&'static str]); 3] =
        [(23, 3, &["commit", "decommit"]), (29, 3, &["commit", "decommit", "deallocate"]), (31, 5, &[])];
    for kind in [PoolKind::Split, PoolKind::Binned, PoolKind::None] {
        let (mut total, mut pages) = (0, (0, 0));
        let mut hits: BTreeMap<&'static str, u64> = BTreeMap::new();
        for (seed, random, only) in runs {
            let c = churn(kind, 0, random, seed * 7919, ops / runs.len(), only, true);
            total += c.faults;
            pages = (pages.0 + c.page_ops.0, pages.1 + c.page_ops.1);
            for (k, v) in c.hits {
                *hits.entry(k).or_default() += v;
            }
        }
        println!("{kind:?}: {ops} operations, page-mapped, {total} faults injected, {} page runs committed and {} decommitted, books exact throughout; failed page calls by step: {hits:?}", pages.0, pages.1);
        if kind == PoolKind::None {
            assert_eq!(pages, (0, 0), "{kind:?}: a pool that caches nothing committed or decommitted pages");
            continue;
        }
        let missed: Vec<&&str> = PAGE_STEPS.iter().filter(|t| !hits.contains_key(**t)).collect();
        assert!(missed.is_empty() || (kind == PoolKind::Binned && fault_ops() < BINNED_ALL_STEPS_FROM), "{kind:?}: no failure was injected at {missed:?}");
        assert!(pages.1 > 0 && total > 100, "{kind:?}: the churn decommitted nothing, or injected almost nothing ({total})");
    }
}
