//! The arena on the host upstream's simulated VMM (memfd-backed granules; unmapped address
//! space is PROT_NONE, so a block handed out over an unmapped granule crashes the test).
//! What it must show: memory held stays near the live peak however the free space is
//! scattered, a repeated step makes no driver call, pressure gives whole granules back,
//! each range grows into the other's free granules before mapping new memory, a loan whose
//! alias cannot be removed is quarantined and retried, and a device without VMM falls back
//! to `split` with a notice. Chunked growth is in `arena_chunks.rs`, the long randomized
//! runs against a model in `arena_model.rs`.

#[macro_use]
mod common;
mod arena_support;

use arena_support::{pool, G};
use common::*;
use gpupool::config::PoolKind;
use gpupool::error::{Error, Result};
use gpupool::stream::StreamHandle;
use gpupool::upstream::host::HostUpstream;
use gpupool::upstream::{AllocError, Events, Ipc, Memory, VirtualMemory};
use gpupool::{Pool, PoolOptions};

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
    assert!(arena.arena_figures().unwrap().counters.stitches_made > 0, "the big block was stitched");
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
fn a_request_no_stitch_could_hold_keeps_the_cached_stitches() {
    // A request larger than the whole stitch range can never be stitched: planning it must
    // not evict cached stitches one by one (each eviction waits for its stream and removes
    // its aliases, and the next step has to stitch again), and it fails cleanly.
    let mut p = pool(PoolKind::Arena, 1 << 30);
    let blocks: Vec<usize> = (0..4).map(|_| p.malloc(2 * G, 0).unwrap()).collect();
    p.free(blocks[0], 0).unwrap();
    p.free(blocks[2], 0).unwrap();
    let big = p.malloc(4 * G, 0).unwrap();
    p.free(big, 0).unwrap();
    let made = p.arena_figures().unwrap().counters;
    assert_eq!((made.stitches_made, made.stitches_dropped), (1, 0));
    assert!(p.malloc(1 << 46, 0).is_err(), "64 TiB cannot be served");
    // Nor 1.5 GiB on this 1 GiB device (its large range, twice the device, could hold it).
    assert!(matches!(p.malloc(3 << 29, 0), Err(Error::OutOfMemory(_))));
    let c = p.arena_figures().unwrap().counters;
    assert_eq!((c.stitches_dropped, c.granules_unmapped), (0, 0), "an impossible request evicted the cached stitch: {c:?}");
    // Nor one larger than any block the arena's address ranges could hold (here the
    // device has 1 GiB and `GPUPOOL_ARENA_VA` is 64 MiB: no release could help it).
    let mut small_va = Pool::new(0, Box::new(HostUpstream::new(1 << 30)), &PoolOptions { kind: PoolKind::Arena, arena_va: Some(64 * MIB), ..Default::default() }).unwrap();
    let held: Vec<usize> = (0..4).map(|_| small_va.malloc(2 * G, 0).unwrap()).collect();
    small_va.free(held[0], 0).unwrap();
    small_va.free(held[2], 0).unwrap();
    let s = small_va.malloc(4 * G, 0).unwrap();
    small_va.free(s, 0).unwrap();
    assert!(matches!(small_va.malloc(100 * MIB, 0), Err(Error::OutOfMemory(_))));
    let c = small_va.arena_figures().unwrap().counters;
    assert_eq!((c.stitches_dropped, c.granules_unmapped), (0, 0), "{c:?}");
    for b in [held[1], held[3]] {
        small_va.free(b, 0).unwrap();
    }
    // The stitch still serves its size with no driver call.
    let before = p.driver_calls();
    let again = p.malloc(4 * G, 0).unwrap();
    assert_eq!(p.driver_calls(), before, "the cached stitch served again: {}", p.driver_calls().text());
    assert_eq!(p.arena_figures().unwrap().counters.stitch_reuses, 1);
    for b in [again, blocks[1], blocks[3]] {
        p.free(b, 0).unwrap();
    }
}

#[test]
fn with_piece_ends_a_full_stitch_cache_still_serves_from_pieces_where_new_memory_is_refused() {
    // While the stitch cache is full, piece ends give way to a window (no eviction for a
    // stitch that only pieces make worth making); where the limit refuses that window, the
    // growth plans again with pieces, which need no new memory.
    let opts = PoolOptions { kind: PoolKind::Arena, thread_cache: false, decay_window: 0, arena_chunk: 0, arena_piece_ends: true, ..Default::default() };
    let mut p = Pool::new(0, Box::new(HostUpstream::new(8 << 30)), &opts).unwrap();
    // 256 idle stitches (the cache's capacity) over granules that are in use again.
    for i in 0..256 {
        let s1 = p.malloc(G, 0).unwrap();
        let _k1 = p.malloc(G, 0).unwrap();
        let s2 = p.malloc(G, 0).unwrap();
        let _k2 = p.malloc(G, 0).unwrap();
        p.free(s1, 0).unwrap();
        p.free(s2, 0).unwrap();
        let big = p.malloc(2 * G, 0).unwrap();
        p.free(big, 0).unwrap();
        assert_eq!((p.malloc(G, 0).unwrap(), p.malloc(G, 0).unwrap()), (s1, s2));
        assert_eq!(p.arena_figures().unwrap().counters.stitches_made, i + 1);
    }
    // Free memory: the end of a granule, two whole granules, the start of another.
    let head = p.malloc(5 * MIB / 4, 0).unwrap();
    let _a = p.malloc(11 * MIB / 4, 0).unwrap();
    let _b = p.malloc(3 * MIB, 0).unwrap();
    let tail = p.malloc(5 * MIB, 0).unwrap();
    p.free(head, 0).unwrap();
    p.free(tail, 0).unwrap();
    let held = p.stats().total_bytes as usize;
    p.set_limit(held).unwrap();
    let before = p.arena_figures().unwrap().counters;
    let got = p.malloc(25 * MIB / 4, 0).expect("served from pieces and whole free granules, with no new memory");
    let after = p.arena_figures().unwrap().counters;
    assert_eq!((after.granules_mapped, after.stitches_dropped, after.stitch_pieces), (before.granules_mapped, before.stitches_dropped + 1, before.stitch_pieces + 2), "{after:?}");
    p.free(got, 0).unwrap();
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
    assert_eq!(p.arena_figures().unwrap().counters.stitches_made, 1, "served by a stitch");
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
    // A 3.25 MiB block maps 2 granules and leaves 768 KiB free in the second: a scrap no
    // large request or loan can use. A 512 KiB request takes it instead of mapping a
    // granule of the small range.
    let mut p = pool(PoolKind::Arena, 1 << 30);
    let big_size = 3 * MIB + MIB / 4;
    let big = p.malloc(big_size, 0).unwrap();
    stamp(big, big_size, 1);
    let small = p.malloc(512 * 1024, 0).unwrap();
    stamp(small, 512 * 1024, 2);
    assert_eq!(p.stats().total_bytes as usize, 2 * G, "no new granule: {}", p.memory_status());
    assert!(small >= big + big_size && small < big + 2 * G, "served from the scrap after the big block");
    assert!(intact(big, big_size, 1) && intact(small, 512 * 1024, 2));
    // A second one does not fit the rest of the scrap (256 KiB left, 384 KiB asked): the
    // small range maps its own granule.
    let third = p.malloc(384 * 1024, 0).unwrap();
    assert!(!(big..big + 2 * G).contains(&third), "the third crumb went to the small range");
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

impl Memory for NoVmm {
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

impl VirtualMemory for NoVmm {}

impl Ipc for NoVmm {}

impl Events for NoVmm {}

#[test]
fn without_vmm_the_arena_falls_back_to_split_with_a_notice() {
    let opts = PoolOptions { kind: PoolKind::Arena, check_invariants: true, ..Default::default() };
    let mut p = Pool::new(0, Box::new(NoVmm(HostUpstream::new(1 << 30))), &opts).unwrap();
    assert_eq!(p.strategy_name(), "split");
    let status = p.memory_status();
    assert_eq!(status.lines().filter(|l| l.contains("Notice: arena unavailable")).count(), 1, "{status}");
    assert!(p.stats_json().contains("\"notice\":\"arena unavailable"));
    let a = p.malloc(MIB, 0).unwrap();
    p.free(a, 0).unwrap();
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
    assert_eq!(p.arena_figures().unwrap().counters.granules_lent, 3);
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
    let c = p.arena_figures().unwrap().counters;
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

impl Memory for StickyAliases {
    fn name(&self) -> &'static str {
        "sticky-aliases"
    }
    host_memory!();
    fn driver_calls(&self) -> gpupool::upstream::DriverCalls {
        self.host.driver_calls()
    }
}

impl VirtualMemory for StickyAliases {
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
}

impl Ipc for StickyAliases {}

impl Events for StickyAliases {}

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
    // From here the alias's removal keeps failing until the last reclaim below.
    unalias.store(1_000, std::sync::atomic::Ordering::SeqCst);
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
    // While the stale alias stays (its removal fails again at this reclaim), the granule it
    // shows is not given back: on the GPU the driver would keep that memory for the alias,
    // and the books would count a granule less than the device holds.
    // (The loans' aliases cannot be removed either, so they stay too: each counts once.)
    p.reclaim().unwrap();
    let c = p.arena_figures().unwrap().counters;
    let lent_now = (c.granules_lent - c.loans_ended) as usize;
    assert_eq!(p.stats().total_bytes as usize, (lent_now + 1) * 2 * MIB, "the stale alias's granule is kept and counted once: {}", p.memory_status());
    p.check_invariants().unwrap();
    // Reclaim removes the stale alias and gives everything back.
    unalias.store(0, std::sync::atomic::Ordering::SeqCst);
    p.reclaim().unwrap();
    assert_eq!(p.stats().total_bytes, 0, "{}", p.memory_status());
    p.check_invariants().unwrap();
    let again = p.malloc(512 * 1024, 0).unwrap();
    p.free(again, 0).unwrap();
}

#[test]
fn a_request_over_a_lowered_limit_is_still_served_from_memory_reserved_before() {
    // The limit refuses new memory, not memory already held: freed on another stream, the
    // 8 MiB reserved before the limit fell to 4 MiB serve a 6 MiB request once the waits
    // of the escalation made them reusable. A request no release could help fails only
    // after those waits.
    for kind in [PoolKind::Arena, PoolKind::Split] {
        let opts = PoolOptions { kind, check_invariants: true, thread_cache: false, ..Default::default() };
        let mut p = Pool::new(0, Box::new(HostUpstream::new(1 << 30)), &opts).unwrap();
        let (x, y) = (0x1000, 0x2000);
        let a = p.malloc(8 * MIB, x).unwrap();
        p.set_limit(4 * MIB).unwrap();
        p.free(a, x).unwrap();
        let b = p.malloc(6 * MIB, y).unwrap_or_else(|e| panic!("{kind:?}: {e}"));
        p.free(b, y).unwrap();
        assert!(matches!(p.malloc(16 * MIB, y), Err(Error::OutOfMemory(_))), "{kind:?}");
    }
}

#[test]
fn while_another_shard_grows_a_small_request_maps_new_memory_unless_the_limit_refuses_it() {
    // Four 2-granule blocks, every other one freed: 4 free granules in two runs, as above.
    let setup = |limit: usize| {
        let mut p = pool(PoolKind::Arena, 1 << 30);
        let blocks: Vec<usize> = (0..4).map(|_| p.malloc(2 * G, 0).unwrap()).collect();
        p.free(blocks[0], 0).unwrap();
        p.free(blocks[2], 0).unwrap();
        p.set_limit(limit).unwrap();
        (p, blocks)
    };
    // A 4-granule request while another shard's growth is under way (which marks the
    // device contended as this one begins): its memory created anew, and whether stitched.
    let contended_malloc = |p: &mut Pool| {
        let budget = p.budget().clone();
        let _other_shard = budget.contention().begin();
        drop(budget.contention().begin()); // a growth that began while the other was under way
        let before = p.driver_calls();
        let big = p.malloc(4 * G, 0).unwrap();
        (big, p.driver_calls().mem_create - before.mem_create, p.arena_figures().unwrap().counters.stitches_made)
    };
    let (mut p, blocks) = setup(0);
    let (big, created, stitched) = contended_malloc(&mut p);
    assert_eq!((created, stitched), (4, 0), "new memory, no stitch");
    assert_eq!(p.stats().total_bytes as usize, 12 * G);
    for b in [big, blocks[1], blocks[3]] {
        p.free(b, 0).unwrap();
    }
    // With the limit at what is held, new memory is refused: the stitch serves after all,
    // with nothing released first.
    let (mut q, blocks) = setup(8 * G);
    let (big, created, stitched) = contended_malloc(&mut q);
    assert_eq!((created, stitched), (0, 1), "stitched from the free granules");
    assert_eq!(q.stats().total_bytes as usize, 8 * G);
    stamp(big, 4 * G, 9);
    assert!(intact(big, 4 * G, 9));
    for b in [big, blocks[1], blocks[3]] {
        q.free(b, 0).unwrap();
    }
    // Growths one after another, as a single thread's, never mark the device: stitched.
    let (mut r, blocks) = setup(0);
    drop(r.budget().contention().begin());
    let big = r.malloc(4 * G, 0).unwrap();
    assert_eq!(r.arena_figures().unwrap().counters.stitches_made, 1);
    for b in [big, blocks[1], blocks[3]] {
        r.free(b, 0).unwrap();
    }
}
