//! Cache decay and page decommit on the host upstream (page-mapped like `vmm`: decommitted
//! pages are PROT_NONE, so handing one out crashes the test instead of passing quietly).

mod common;

use common::*;
use gpupool::config::PoolKind;
use gpupool::{Pool, PoolOptions};
use gpupool::upstream::host::{HostUpstream, HOST_PAGE};

fn pool(decay_window: usize) -> Pool {
    pool_of(PoolKind::Split, decay_window)
}

fn pool_of(kind: PoolKind, decay_window: usize) -> Pool {
    let opts = PoolOptions { kind, check_invariants: true, decay_window, ..Default::default() };
    Pool::new(0, Box::new(HostUpstream::new(4 << 30)), &opts).unwrap()
}

/// Write every byte of a block: any decommitted page in it faults.
fn fill(addr: usize, len: usize, v: u8) {
    // SAFETY: the pool handed us [addr, addr + len) on the host upstream.
    unsafe { std::ptr::write_bytes(addr as *mut u8, v, len) }
}

fn all(addr: usize, len: usize, v: u8) -> bool {
    // SAFETY: as in `fill`.
    unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.iter().all(|&b| b == v)
}

#[test]
fn free_pages_between_live_blocks_go_back_and_come_back_before_reuse() {
    let mut p = pool(0);
    // Three 6 MiB blocks share one 20 MiB segment; the middle one spans whole pages.
    let blocks: Vec<usize> = (0..3).map(|_| p.malloc(6 * MIB, 0).unwrap()).collect();
    for (i, &b) in blocks.iter().enumerate() {
        fill(b, 6 * MIB, i as u8 + 1);
    }
    p.free(blocks[1], 0).unwrap();
    let before = p.stats();
    // The segment is not wholly free, so only page decommit can give memory back.
    let released = p.reclaim().unwrap();
    let after = p.stats();
    assert!(released >= 2 * HOST_PAGE, "whole pages inside the free block went back ({released} B)");
    assert_eq!(after.total_bytes, before.total_bytes - released as u64);
    assert!(all(blocks[0], 6 * MIB, 1) && all(blocks[2], 6 * MIB, 3), "neighbours untouched");
    // The same request gets the same place; its pages are backed again before we touch it.
    let again = p.malloc(6 * MIB, 0).unwrap();
    assert_eq!(again, blocks[1]);
    fill(again, 6 * MIB, 9);
    assert!(all(again, 6 * MIB, 9));
    // The block is page aligned (2 MiB pages, 6 MiB offset): exactly its pages came back.
    assert_eq!(p.stats().total_bytes, after.total_bytes + 6 * MIB as u64);
    for b in [blocks[0], again, blocks[2]] {
        p.free(b, 0).unwrap();
    }
    p.reclaim().unwrap();
    assert_eq!(p.stats().total_bytes, 0);
}

/// A seeded churn like the framework benchmark (live slots replaced at random, log-uniform
/// sizes), with every block's bytes checked before it is freed.
fn churn(p: &mut Pool, steps: usize) -> (u64, u64) {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut slots: Vec<Option<(usize, usize, u8)>> = vec![None; 64];
    for step in 0..steps {
        let s = next() as usize % slots.len();
        if let Some((a, n, v)) = slots[s].take() {
            assert!(all(a, n, v), "block {a:#x} overwritten");
            p.free(a, 0).unwrap();
        }
        // log-uniform in [512 B, 16 MiB)
        let n = (512f64 * (32768f64).powf((next() % 10_000) as f64 / 10_000.0)) as usize;
        let a = p.malloc(n, 0).unwrap();
        let v = (step % 251) as u8 + 1;
        fill(a, n, v);
        slots[s] = Some((a, n, v));
    }
    let st = p.stats();
    for (a, n, v) in slots.into_iter().flatten() {
        assert!(all(a, n, v));
        p.free(a, 0).unwrap();
    }
    (st.total_bytes, st.requested_bytes)
}

#[test]
fn decay_keeps_reserved_near_the_recent_peak_and_never_hands_out_a_decommitted_page() {
    let (kept_all, live) = churn(&mut pool(0), 3000);
    let mut decaying = pool(256);
    let (decayed, live2) = churn(&mut decaying, 3000);
    assert_eq!(live, live2, "same sequence");
    assert!(
        decayed < kept_all,
        "decay must end with less reserved than keeping everything: {decayed} vs {kept_all} for {live} live"
    );
    let st = decaying.stats();
    assert!(st.reclaimed_bytes > 0 && st.n_upstream_frees > 0, "decay released memory: {st:?}");
}

#[test]
fn decay_gives_the_arenas_free_granules_back() {
    let (kept_all, live) = churn(&mut pool_of(PoolKind::Arena, 0), 3000);
    let mut decaying = pool_of(PoolKind::Arena, 256);
    let (decayed, live2) = churn(&mut decaying, 3000);
    assert_eq!(live, live2, "same sequence");
    assert!(decayed < kept_all, "decay must end with less mapped: {decayed} vs {kept_all} for {live} live");
    let c = decaying.arena_figures().unwrap().counters;
    assert!(c.granules_unmapped > 0 && decaying.stats().reclaimed_bytes > 0, "{c:?}");
}

#[test]
fn decay_costs_a_steady_loop_at_most_one_trim_per_epoch() {
    // The same allocations every iteration: the peak stays in the window, no segment goes
    // back. Pages free at the moment of a trim may be decommitted and recommitted by the
    // next iteration; decay bounds that to one trim per epoch (window / 8 allocations).
    let window = 256;
    let iterations = 200;
    let mut p = pool(window);
    for i in 0..iterations {
        let v: Vec<usize> = [3 * MIB, 700_000, 12 * MIB, 5000].iter().map(|&n| p.malloc(n, 0).unwrap()).collect();
        for (k, &a) in v.iter().enumerate() {
            fill(a, 4096, (i + k) as u8);
        }
        for a in v {
            p.free(a, 0).unwrap();
        }
    }
    let st = p.stats();
    let (commits, decommits) = p.page_ops();
    let epochs = (iterations * 4 / (window / 8)) as u64;
    assert_eq!(st.n_upstream_frees, 0, "{st:?}");
    assert_eq!(st.n_upstream_allocs, 2, "{st:?}");
    assert!(decommits <= epochs && commits <= decommits, "{commits} commits, {decommits} decommits in {epochs} epochs");
    eprintln!("steady loop: {commits} page commits, {decommits} decommits in {epochs} epochs");
}

#[test]
fn what_a_stitched_block_holds_beyond_its_size_is_neither_in_use_nor_releasable() {
    // A stitched block of 5.5 granules holds its sixth granule whole. The half it does not
    // use is cached in the stats, but nothing can give it back while the block lives: the
    // pool's releasable bytes (what decay and other shards' pressure act on) leave it out.
    const G: usize = 2 * MIB;
    let mut p = pool_of(PoolKind::Arena, 0);
    let blocks: Vec<usize> = (0..8).map(|_| p.malloc(2 * G, 0).unwrap()).collect();
    for &b in blocks.iter().step_by(2) {
        p.free(b, 0).unwrap();
    }
    let big = p.malloc(5 * G + G / 2, 0).unwrap();
    assert_eq!(p.arena_figures().unwrap().counters.stitches_made, 1, "the block is stitched");
    let st = p.stats();
    assert_eq!(st.used_bytes as usize, 4 * 2 * G + 5 * G + G / 2);
    assert_eq!(st.free_bytes as usize, 2 * G + G / 2, "two free granules and the stitched block's unused half");
    assert_eq!(p.cached_bytes(), 2 * G, "only the free granules could go back");
    p.reclaim().unwrap();
    assert_eq!(p.stats().total_bytes as usize, 4 * 2 * G + 6 * G);
    p.free(big, 0).unwrap();
    for &b in blocks.iter().skip(1).step_by(2) {
        p.free(b, 0).unwrap();
    }
}
