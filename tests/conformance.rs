//! One conformance suite, instantiated for every strategy on the host upstream (RMM's typed
//! suites are the model). Every pool here runs the full invariant scan after each operation.

mod common;

use common::*;
use gpupool::config::PoolKind;
use gpupool::error::{BadPointer, Error};
use gpupool::Pool;

const LEGACY: usize = 0;

/// The documented rounding of each strategy.
fn rounded(kind: PoolKind, size: usize) -> usize {
    match kind {
        PoolKind::Split | PoolKind::Arena => size.div_ceil(512) * 512,
        PoolKind::Binned => size.max(512).next_power_of_two(),
        PoolKind::None => size.div_ceil(256) * 256,
    }
}

fn caches(kind: PoolKind) -> bool {
    kind != PoolKind::None
}

fn alignment(kind: PoolKind) {
    let mut p = host_pool(kind, 1 << 30);
    let mut live = Vec::new();
    for (i, size) in [1usize, 7, 255, 256, 257, 511, 512, 513, 4095, 65537, MIB - 1, MIB + 1, 3 * MIB + 5].into_iter().enumerate() {
        let a = p.malloc(size, LEGACY).unwrap();
        assert_ne!(a, 0);
        assert_eq!(a % 256, 0, "{kind:?}: {size} B at {a:#x} not 256-aligned");
        stamp(a, size, i as u64);
        live.push((a, size, i as u64));
    }
    for (a, size, id) in &live {
        assert!(intact(*a, *size, *id), "{kind:?}: block {a:#x} overwritten");
    }
    for (a, _, _) in live {
        p.free(a, LEGACY).unwrap();
    }
}

fn no_overlap(kind: PoolKind) {
    let mut p = host_pool(kind, 1 << 30);
    let mut rng = 0x1234_5678u64;
    let mut live: Vec<(usize, usize, u64)> = Vec::new();
    for id in 0..3000u64 {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        if live.len() > 40 || (rng % 3 == 0 && !live.is_empty()) {
            let (a, s, i) = live.swap_remove((rng as usize / 3) % live.len());
            assert!(intact(a, s, i), "{kind:?}: live block {a:#x} was overwritten");
            p.free(a, LEGACY).unwrap();
        } else {
            let size = 1 + (rng as usize >> 8) % (if rng % 5 == 0 { 4 * MIB } else { 64 * 1024 });
            let a = p.malloc(size, LEGACY).unwrap();
            stamp(a, size, id);
            live.push((a, size, id));
        }
    }
    // The invariant scan already checks no live/free spans overlap; check the data too.
    for (a, s, i) in live.drain(..) {
        assert!(intact(a, s, i));
        p.free(a, LEGACY).unwrap();
    }
    assert_eq!(p.stats().used_bytes, 0);
}

fn reuse_after_free(kind: PoolKind) {
    let mut p = host_pool(kind, 1 << 30);
    for size in [512usize, 100_000, 5 * MIB] {
        let a = p.malloc(size, LEGACY).unwrap();
        p.free(a, LEGACY).unwrap();
        let before = p.stats().n_upstream_allocs;
        let b = p.malloc(size, LEGACY).unwrap();
        let after = p.stats().n_upstream_allocs;
        if caches(kind) {
            assert_eq!(a, b, "{kind:?}: same-size request after free must reuse the block");
            assert_eq!(before, after, "{kind:?}: reuse must not call the upstream");
        } else {
            assert_eq!(after, before + 1, "none: every request goes upstream");
        }
        p.free(b, LEGACY).unwrap();
    }
}

fn stats_exact(kind: PoolKind) {
    let mut p = host_pool(kind, 1 << 30);
    let sizes = [1usize, 700, 4096, 300_000, 2 * MIB + 1, 12 * MIB];
    let mut live = Vec::new();
    let mut used = 0;
    let mut requested = 0;
    let mut peak = 0;
    for (i, &s) in sizes.iter().enumerate() {
        let a = p.malloc(s, LEGACY).unwrap();
        live.push((a, s));
        used += rounded(kind, s);
        requested += s;
        peak = peak.max(used);
        let st = p.stats();
        assert_eq!(st.used_bytes as usize, used, "{kind:?} used after alloc {i}");
        assert_eq!(st.requested_bytes as usize, requested);
        assert_eq!(st.n_live_blocks as usize, live.len());
        assert_eq!(st.n_allocs as usize, i + 1);
        assert_eq!(st.free_bytes + st.used_bytes, st.total_bytes);
        assert_eq!(st.peak_used_bytes as usize, peak);
        assert!(st.peak_total_bytes >= st.total_bytes);
        assert!(st.free_bytes >= st.largest_free_block);
    }
    for (i, (a, s)) in live.iter().enumerate() {
        p.free(*a, LEGACY).unwrap();
        used -= rounded(kind, *s);
        requested -= s;
        let st = p.stats();
        assert_eq!(st.used_bytes as usize, used, "{kind:?} used after free {i}");
        assert_eq!(st.requested_bytes as usize, requested);
        assert_eq!(st.n_frees as usize, i + 1);
        assert_eq!(st.free_bytes + st.used_bytes, st.total_bytes);
        if !caches(kind) {
            assert_eq!(st.total_bytes, st.used_bytes, "none caches nothing");
        }
    }
    let st = p.stats();
    assert_eq!(st.n_upstream_allocs - st.n_upstream_frees > 0, caches(kind));
}

/// Whether freed neighbours merge into one free block: the splitting pools (`split`, and
/// the arena, which carves and merges at 512 B) do; `binned` keeps freed blocks in their
/// size's bin and `none` caches nothing.
fn coalesces(kind: PoolKind) -> bool {
    matches!(kind, PoolKind::Split | PoolKind::Arena)
}

fn coalescing(kind: PoolKind) {
    let mut p = host_pool(kind, 1 << 30);
    // Two neighbours cut from one piece of memory (where the pool cuts at all).
    let a = p.malloc(256 * 1024, LEGACY).unwrap();
    let b = p.malloc(256 * 1024, LEGACY).unwrap();
    if coalesces(kind) {
        assert_eq!(b, a + 256 * 1024, "{kind:?} cuts consecutive blocks from one piece of memory");
    }
    let guard = p.malloc(512, LEGACY).unwrap();
    p.free(a, LEGACY).unwrap();
    p.free(b, LEGACY).unwrap();
    let ups = p.stats().n_upstream_allocs;
    let c = p.malloc(512 * 1024, LEGACY).unwrap();
    if coalesces(kind) {
        // Only the merged pair (512 KiB at `a`) fits best: the tail after `guard` is larger.
        assert_eq!(c, a, "{kind:?}: freed neighbours must coalesce into one block");
        assert_eq!(p.stats().n_upstream_allocs, ups, "{kind:?}: the merged pair serves without new memory");
    } else {
        // The two halves serve no request of their sum: new memory (which `none`, having
        // given the halves back, may get at their old addresses).
        assert!(p.stats().n_upstream_allocs > ups, "{kind:?} merged freed blocks it should keep apart");
        if kind == PoolKind::Binned {
            let over = |x: usize| c < x + 256 * 1024 && x < c + 512 * 1024;
            assert!(!over(a) && !over(b), "{kind:?} handed out {c:#x} over the cached halves at {a:#x} and {b:#x}");
        }
    }
    // Everything freed: the memory goes back whole.
    p.free(c, LEGACY).unwrap();
    p.free(guard, LEGACY).unwrap();
    p.reclaim().unwrap();
    assert_eq!(p.stats().total_bytes, 0, "{kind:?}: everything freed and reclaimed, nothing stays reserved");
}

fn limits(kind: PoolKind) {
    let mut p = host_pool(kind, 1 << 30);
    p.set_limit(8 * MIB).unwrap();
    assert_eq!(p.budget().limit(), 8 * MIB);
    let a = p.malloc(3 * MIB, LEGACY).unwrap();
    let b = p.malloc(3 * MIB, LEGACY).unwrap();
    assert!(p.stats().total_bytes as usize <= 8 * MIB);
    let before = p.stats();
    let e = p.malloc(3 * MIB, LEGACY).unwrap_err();
    match &e {
        Error::OutOfMemory(r) => {
            assert!(r.by_limit, "{kind:?}: the limit refused it: {e}");
            assert_eq!(r.limit, 8 * MIB);
        }
        other => panic!("expected OOM, got {other}"),
    }
    let msg = e.to_string();
    assert!(msg.contains("limit") && msg.contains("3.00 MiB"), "{msg}");
    let after = p.stats();
    assert_eq!(after.used_bytes, before.used_bytes, "a failed malloc changes nothing");
    assert_eq!(after.n_ooms, before.n_ooms + 1);
    // Cached memory of another size is released to make room under the limit.
    p.free(a, LEGACY).unwrap();
    p.free(b, LEGACY).unwrap();
    let c = p.malloc(7 * MIB, LEGACY).unwrap();
    assert!(p.stats().total_bytes as usize <= 8 * MIB);
    p.free(c, LEGACY).unwrap();
    // Lowering the limit under the reserved bytes releases cache at once.
    p.set_limit(MIB).unwrap();
    assert!(p.stats().total_bytes as usize <= MIB);
    p.set_limit(0).unwrap();
    let d = p.malloc(64 * MIB, LEGACY).unwrap();
    p.free(d, LEGACY).unwrap();
}

fn reclaim_exact(kind: PoolKind) {
    let mut p = host_pool(kind, 1 << 30);
    let ptrs: Vec<usize> = [1000usize, 200_000, 3 * MIB, 30 * MIB].iter().map(|&s| p.malloc(s, LEGACY).unwrap()).collect();
    // With one block still live, only wholly free segments can go.
    for &a in &ptrs[1..] {
        p.free(a, LEGACY).unwrap();
    }
    let st = p.stats();
    let released = p.reclaim().unwrap();
    let st2 = p.stats();
    assert_eq!(st2.total_bytes, st.total_bytes - released as u64);
    assert_eq!(st2.used_bytes, st.used_bytes);
    assert_eq!(st2.n_reclaims, st.n_reclaims + 1);
    p.free(ptrs[0], LEGACY).unwrap();
    let cached = p.stats().free_bytes as usize;
    let released = p.reclaim().unwrap();
    assert_eq!(released, cached, "{kind:?}: reclaim with nothing live returns exactly the cached bytes");
    let st3 = p.stats();
    assert_eq!((st3.total_bytes, st3.free_bytes, st3.n_free_blocks), (0, 0, 0));
    match p.arena_figures().map(|f| f.counters) {
        // The arena maps and unmaps runs of granules, not segments: count granules.
        Some(c) => assert_eq!(c.granules_mapped, c.granules_unmapped),
        None => assert_eq!(st3.n_upstream_allocs, st3.n_upstream_frees),
    }
}

fn bad_inputs(kind: PoolKind) {
    let mut p = host_pool(kind, 256 * MIB);
    assert_eq!(p.malloc(0, LEGACY).unwrap(), 0, "size 0 gives NULL");
    p.free(0, LEGACY).unwrap();
    let a = p.malloc(4096, LEGACY).unwrap();
    let keep = p.malloc(4096, LEGACY).unwrap();
    p.free(a, LEGACY).unwrap();
    let snap = p.stats();
    // Double free.
    let e = p.free(a, LEGACY).unwrap_err();
    if caches(kind) {
        assert!(
            matches!(e, Error::InvalidPointer { why: BadPointer::AlreadyFreed, .. }),
            "{kind:?}: {e}"
        );
        assert!(e.to_string().contains("double free"));
    } else {
        assert!(matches!(e, Error::InvalidPointer { .. }));
    }
    // Interior pointer of a live block.
    let e = p.free(keep + 256, LEGACY).unwrap_err();
    assert!(matches!(e, Error::InvalidPointer { why: BadPointer::Interior { .. }, .. }), "{e}");
    assert!(e.to_string().contains("inside the live block"));
    // Never ours.
    let e = p.free(0xdead_0000, LEGACY).unwrap_err();
    assert!(matches!(e, Error::InvalidPointer { why: BadPointer::Unknown, .. }));
    // Sizes near SIZE_MAX: out of memory, no overflow, no panic.
    for s in [usize::MAX, usize::MAX - 1, usize::MAX - 511, isize::MAX as usize, 1 << 62, 300 * MIB] {
        let e = p.malloc(s, LEGACY).unwrap_err();
        assert!(matches!(e, Error::OutOfMemory(_)), "{kind:?}: size {s}: {e}");
    }
    let after = p.stats();
    assert_eq!(after.used_bytes, snap.used_bytes, "bad input changed the pool");
    assert_eq!(after.n_live_blocks, snap.n_live_blocks);
    assert_eq!(after.n_invalid_frees, snap.n_invalid_frees + 3);
    assert!(p.owns(keep));
    p.free(keep, LEGACY).unwrap();
}

fn oom_recovers_by_releasing_cache(kind: PoolKind) {
    // A 64 MiB "device": fill it with cached blocks of one size, then ask for another size.
    let mut p = host_pool(kind, 64 * MIB);
    let mut v = Vec::new();
    while let Ok(a) = p.malloc(8 * MIB, LEGACY) {
        v.push(a);
        if v.len() > 64 {
            break;
        }
    }
    assert!(!v.is_empty());
    for a in v {
        p.free(a, LEGACY).unwrap();
    }
    let before = p.stats();
    let big = p.malloc(40 * MIB, LEGACY).expect("cached memory must be released and the request retried");
    if kind == PoolKind::Arena {
        // The arena needs no release: its freed blocks coalesced across the whole range.
        assert_eq!(p.stats().total_bytes, before.total_bytes);
    } else {
        assert!(p.stats().reclaimed_bytes > 0 || !caches(kind));
    }
    let e = p.malloc(40 * MIB, LEGACY).unwrap_err();
    let msg = e.to_string();
    assert!(msg.starts_with("CUDA out of memory. "), "OOM message does not start with PyTorch's phrase: {msg}");
    for needle in ["out of memory", "40.00 MiB", "Device:", "reserved", "in use", "cached", "largest free block", "limit", "Hint"] {
        assert!(msg.contains(needle), "OOM message lacks {needle:?}: {msg}");
    }
    p.free(big, LEGACY).unwrap();
}

fn reports_agree_with_stats(kind: PoolKind) {
    let mut p = host_pool(kind, 1 << 30);
    let a = p.malloc(123_456, LEGACY).unwrap();
    let st = p.stats();
    let json = p.stats_json();
    // Every number of the struct appears in the JSON under its own name.
    for (name, v) in [
        ("used_bytes", st.used_bytes),
        ("free_bytes", st.free_bytes),
        ("total_bytes", st.total_bytes),
        ("n_free_blocks", st.n_free_blocks),
        ("n_live_blocks", st.n_live_blocks),
        ("requested_bytes", st.requested_bytes),
        ("peak_used_bytes", st.peak_used_bytes),
        ("peak_total_bytes", st.peak_total_bytes),
        ("n_allocs", st.n_allocs),
        ("n_frees", st.n_frees),
        ("n_upstream_allocs", st.n_upstream_allocs),
        ("n_upstream_frees", st.n_upstream_frees),
        ("n_ooms", st.n_ooms),
        ("n_reclaims", st.n_reclaims),
        ("reclaimed_bytes", st.reclaimed_bytes),
        ("n_invalid_frees", st.n_invalid_frees),
        ("limit_bytes", st.limit_bytes),
        ("largest_free_block", st.largest_free_block),
        ("device_free_bytes", st.device_free_bytes),
        ("device_total_bytes", st.device_total_bytes),
        ("n_cross_stream_reuses", st.n_cross_stream_reuses),
        ("n_deferred_frees", st.n_deferred_frees),
    ] {
        let field = format!("\"{name}\":{v}");
        assert!(
            json.contains(&format!("{field},")) || json.contains(&format!("{field}}}")),
            "{name}={v} missing from {json}"
        );
    }
    assert!(json.contains(&format!("\"strategy\":\"{}\"", kind.name())));
    let text = p.memory_status();
    let h = |n: u64| gpupool::error::human_bytes(n as usize);
    for needle in [
        format!("{} in use, {} cached, {} reserved", h(st.used_bytes), h(st.free_bytes), h(st.total_bytes)),
        format!("peak: {} in use, {} reserved", h(st.peak_used_bytes), h(st.peak_total_bytes)),
        format!("{} live, {} free; largest free block {}", st.n_live_blocks, st.n_free_blocks, h(st.largest_free_block)),
        format!("{} allocs, {} frees, {} upstream allocs", st.n_allocs, st.n_frees, st.n_upstream_allocs),
        "Limit: none".to_string(),
    ] {
        assert!(text.contains(&needle), "status report lacks {needle:?}:\n{text}");
    }
    p.free(a, LEGACY).unwrap();
}

fn fresh_pool_after_everything_freed_keeps_invariants(kind: PoolKind) {
    let mut p: Pool = host_pool(kind, 1 << 30);
    let v: Vec<usize> = (1..200).map(|i| p.malloc(i * 3001, LEGACY).unwrap()).collect();
    for a in v.into_iter().rev() {
        p.free(a, LEGACY).unwrap();
    }
    p.check_invariants().unwrap();
    assert_eq!(p.stats().used_bytes, 0);
}

macro_rules! suite {
    ($($name:ident => $kind:expr),* $(,)?) => {$(
        mod $name {
            use super::*;
            #[test] fn alignment() { super::alignment($kind) }
            #[test] fn no_overlap() { super::no_overlap($kind) }
            #[test] fn reuse_after_free() { super::reuse_after_free($kind) }
            #[test] fn stats_exact() { super::stats_exact($kind) }
            #[test] fn coalescing() { super::coalescing($kind) }
            #[test] fn limits() { super::limits($kind) }
            #[test] fn reclaim_exact() { super::reclaim_exact($kind) }
            #[test] fn bad_inputs() { super::bad_inputs($kind) }
            #[test] fn oom_recovers_by_releasing_cache() { super::oom_recovers_by_releasing_cache($kind) }
            #[test] fn reports_agree_with_stats() { super::reports_agree_with_stats($kind) }
            #[test] fn free_all_keeps_invariants() { super::fresh_pool_after_everything_freed_keeps_invariants($kind) }
        }
    )*};
}

suite! {
    split => PoolKind::Split,
    binned => PoolKind::Binned,
    none => PoolKind::None,
    arena => PoolKind::Arena,
}
