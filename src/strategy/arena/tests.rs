//! Unit tests of the arena's books, driven as the pool drives them, with every driver call
//! succeeding: carving and coalescing, stitches, exports, the two ranges, streams, release.

use super::*;

const G: usize = 2 << 20;
const L: StreamKey = StreamKey::LEGACY;

fn arena() -> ArenaStrategy {
    ArenaStrategy::new((1 << 40, 64 * G), (2 << 40, 256 * G), (3 << 40, 256 * G), G)
}

/// Serve a request as the pool would, with unlimited memory and every driver call
/// succeeding; returns the block and how many granules were mapped or aliased.
fn grow(a: &mut ArenaStrategy, rounded: usize, stream: StreamKey) -> (Block, usize) {
    grow_under(a, rounded, stream, PlanRules::default())
}

/// `grow` under the plan rules `rules` (what a step of the pool's growth allows).
fn grow_under(a: &mut ArenaStrategy, rounded: usize, stream: StreamKey, rules: PlanRules) -> (Block, usize) {
    if let Some(b) = a.take(rounded, stream, &mut |_, _, _| true) {
        return (b, 0);
    }
    loop {
        let b = match a.plan(rounded, stream, rules, &mut |_, _, _| true).expect("address space left") {
            Growth::Window { space, window } => {
                for &t in &window.targets {
                    a.mapped(t, G, stream);
                }
                (a.carve_window(space, &window, stream), window.targets.len())
            }
            Growth::Reuse { id, first, granules } => (a.carve_stitch(id, first, granules, rounded, stream, true), 0),
            Growth::Stitch { base, homes, fresh, take, head, tail } => {
                for &f in &fresh {
                    a.mapped(f, G, stream);
                }
                let n = homes.len();
                let id = a.add_stitch(base, homes);
                if head > 0 || tail {
                    (a.carve_pieced_stitch(id, head, tail, rounded, stream), n)
                } else {
                    (a.carve_stitch(id, 0, take, rounded, stream, false), n)
                }
            }
            Growth::Evict { id } => {
                a.drop_stitch(id);
                continue;
            }
        };
        a.check_invariants().unwrap();
        return b;
    }
}

#[test]
fn carves_from_mapped_memory_and_coalesces_across_the_range() {
    let mut a = arena();
    let (x, _) = grow(&mut a, 3 * G / 2, L); // 1.5 granules: 2 mapped
    assert_eq!(a.mapped_bytes(), 2 * G);
    let (y, n) = grow(&mut a, G / 2 + 512, L); // 512 B more than the mapped half granule left
    assert_eq!((y.addr, n), (x.addr + x.size, 1), "carved right after, in the mapped tail and one new granule");
    assert_eq!(a.mapped_bytes(), 3 * G);
    a.put(x);
    a.put(y);
    a.check_invariants().unwrap();
    assert_eq!(a.free_block_count(), 1, "one free block across what were two blocks");
    assert_eq!(a.largest_free_block(), 3 * G);
    let (z, n) = grow(&mut a, 3 * G, L);
    assert_eq!((z.addr, n), (x.addr, 0));
    assert_eq!(a.counters.granules_mapped, 3, "reuse mapped nothing");
}

/// Eight 2-granule blocks, every other one freed: 8 granules free, no 3 in a row.
fn scattered_free_granules() -> ArenaStrategy {
    let mut a = arena();
    let blocks: Vec<Block> = (0..8).map(|_| grow(&mut a, 2 * G, L).0).collect();
    for b in blocks.iter().step_by(2) {
        a.put(*b);
    }
    a
}

#[test]
fn scattered_free_granules_are_stitched_once_and_the_stitch_is_reused() {
    let mut a = scattered_free_granules();
    let mapped = a.mapped_bytes();
    let (big, aliased) = grow(&mut a, 6 * G, L);
    assert_eq!(a.mapped_bytes(), mapped, "no new memory: free granules shown side by side");
    assert_eq!((aliased, a.counters.stitches_made), (6, 1));
    assert_eq!(a.cached_bytes(), 2 * G, "six of the eight free granules are booked for the stitch");
    assert!(a.take(2 * G + 512, L, &mut |_, _, _| true).is_none(), "its granules are not handed out twice");
    // Freed, the stitch stays: the same request again reuses it, no driver call.
    a.put(big);
    assert_eq!(a.cached_bytes(), 8 * G);
    let (again, n) = grow(&mut a, 6 * G, L);
    assert_eq!((again.addr, n, a.counters.stitch_reuses), (big.addr, 0, 1));
    a.put(again);
    // A smaller request takes part of it, also with no driver call.
    let (part, n) = grow(&mut a, 4 * G + 512, L);
    assert_eq!((part.addr, part.size, n, a.counters.stitch_reuses), (big.addr, 4 * G + 512, 0, 2));
    assert_eq!(a.cached_bytes(), 4 * G - 512, "three granules free, and the last one's rest, which the block does not use");
    a.put(part);
    // A home granule handed out directly makes the stitch unavailable, not wrong.
    let (home, _) = grow(&mut a, 2 * G, L);
    let (other, _) = grow(&mut a, 6 * G, L);
    assert_ne!(other.addr, big.addr);
    a.put(home);
    a.put(other);
    a.check_invariants().unwrap();
}

#[test]
fn a_stitched_block_is_its_bytes_and_the_rest_of_its_last_granule_counts_as_cached() {
    let mut a = scattered_free_granules();
    let mapped = a.mapped_bytes();
    // 5.5 granules: a stitch of six, the block its 5.5 granules.
    let (big, aliased) = grow(&mut a, 5 * G + G / 2, L);
    assert_eq!((aliased, a.mapped_bytes()), (6, mapped));
    assert_eq!(big.size, 5 * G + G / 2, "the pool counts the bytes handed out, not the stitch's granules");
    assert_eq!(a.cached_bytes(), 2 * G + G / 2, "two free granules, and the last granule's half the block does not use");
    a.check_invariants().unwrap();
    // The half is the block's: nothing else is placed there, and the block exports as before.
    let last = a.stitches.get(big.handle).homes[5];
    let mut others = Vec::new();
    while let Some(b) = a.take(G / 4 + 512, L, &mut |_, _, _| true) {
        assert!(b.end() <= last || b.addr >= last + G, "a block in the stitched block's last granule");
        others.push(b);
    }
    a.guard_export(big.addr, big.size).unwrap();
    for b in others {
        a.put(b);
    }
    a.put(big);
    a.check_invariants().unwrap();
    assert_eq!(a.cached_bytes(), 8 * G, "the stitch's granules are free again, the tail with them");
}

#[test]
fn with_piece_ends_a_stitch_begins_in_the_free_end_of_a_granule_partly_in_use() {
    let mut a = arena();
    a.set_piece_ends(true);
    // Five blocks of 1.5 granules side by side; the second and fourth freed: granules 2 and
    // 5 whole free, and the free ends of granules 1 and 4 (half a granule each) beside live blocks.
    let blocks: Vec<Block> = (0..5).map(|_| grow(&mut a, G + G / 2, L).0).collect();
    for w in blocks.windows(2) {
        assert_eq!(w[0].end(), w[1].addr, "laid out side by side");
    }
    a.put(blocks[1]);
    a.put(blocks[3]);
    let mapped = a.mapped_bytes();
    // Two and a half granules: two whole free granules and a free end of half a granule, no
    // new memory (without pieces: one new granule).
    let (big, aliased) = grow(&mut a, 2 * G + G / 2, L);
    assert_eq!((a.mapped_bytes(), aliased, a.counters.stitch_pieces), (mapped, 3, 1));
    let st = a.stitches.get(big.handle);
    assert_eq!((big.size, big.addr), (2 * G + G / 2, st.base + G / 2), "the block begins where the piece does");
    let first = st.homes[0];
    assert!(first % G == 0 && (first - blocks[0].addr) % G == 0);
    assert!(a.free_blocks().iter().all(|b| b.end() <= first + G / 2 || b.addr >= first + G), "the piece is the block's");
    a.check_invariants().unwrap();
    // The importer would map the whole first granule, half of which a live block holds.
    assert!(a.guard_export(big.addr, big.size).unwrap_err().contains("stitched block shows"));
    // Everything goes back when the block is freed.
    a.put(big);
    a.check_invariants().unwrap();
    let live: usize = [0, 2, 4].iter().map(|&i| blocks[i].size).sum();
    assert_eq!(a.cached_bytes(), a.mapped_bytes() - live);
    // Off, the same request maps a new granule.
    let mut b = arena();
    let blocks: Vec<Block> = (0..5).map(|_| grow(&mut b, G + G / 2, L).0).collect();
    b.put(blocks[1]);
    b.put(blocks[3]);
    let mapped = b.mapped_bytes();
    grow(&mut b, 2 * G + G / 2, L);
    assert_eq!((b.mapped_bytes(), b.counters.stitch_pieces), (mapped + G, 0));
}

#[test]
fn a_stitch_that_begins_in_a_piece_exports_once_its_neighbour_is_gone() {
    let mut a = arena();
    a.set_piece_ends(true);
    let blocks: Vec<Block> = (0..5).map(|_| grow(&mut a, G + G / 2, L).0).collect();
    a.put(blocks[1]);
    a.put(blocks[3]);
    let (big, _) = grow(&mut a, 2 * G + G / 2, L);
    assert_eq!(a.counters.stitch_pieces, 1);
    let first = a.stitches.get(big.handle).homes[0];
    // Free the live block beside the piece: the export sets its free memory aside.
    let beside = *blocks.iter().find(|b| b.addr < first + G && b.end() > first && b.addr != first + G / 2).unwrap();
    a.put(beside);
    a.guard_export(big.addr, big.size).unwrap();
    assert!(a.take(G / 4 + 512, L, &mut |_, _, _| true).is_none_or(|b| b.end() <= first || b.addr >= first + G), "nothing is placed in the exported block's granule");
    a.check_invariants().unwrap();
    a.put(big);
    a.check_invariants().unwrap();
}

#[test]
fn an_exported_block_keeps_its_granules_to_itself_until_freed() {
    let mut a = arena();
    let (x, _) = grow(&mut a, 64 << 10, L);
    let (y, _) = grow(&mut a, 64 << 10, L);
    assert!(a.guard_export(y.addr, y.size).unwrap_err().contains("shares its"), "x lives in y's granule");
    a.put(x);
    let cached = a.cached_bytes();
    a.guard_export(y.addr, y.size).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.cached_bytes(), cached, "the guards are free memory set aside, still cached");
    // Nothing else is placed in y's granule while it is exported: the next small block
    // needs a granule of its own.
    let (z, mapped) = grow(&mut a, 64 << 10, L);
    assert_eq!(mapped, 1, "a new granule for z");
    assert_ne!(z.addr & !(G - 1), y.addr & !(G - 1));
    // Freed, y's granule is one free block again (its guards went back with it).
    a.put(y);
    a.check_invariants().unwrap();
    let g0 = y.addr & !(G - 1);
    assert!(a.free_blocks().iter().any(|b| (b.addr, b.size) == (g0, G)), "{:?}", a.free_blocks());
    assert_eq!(a.cached_bytes(), 2 * G - z.size, "both granules free but z");
    a.put(z);
}

#[test]
fn small_requests_share_granules_in_their_own_space() {
    let mut a = arena();
    let smalls: Vec<Block> = (0..16).map(|_| grow(&mut a, 64 << 10, L).0).collect();
    assert_eq!(a.mapped_bytes(), G, "16 x 64 KiB share one granule");
    assert!(smalls.iter().all(|b| a.spaces[SMALL].contains(b.addr)));
    let (big, _) = grow(&mut a, 4 << 20, L);
    assert!(a.spaces[LARGE].contains(big.addr));
}

#[test]
fn other_streams_memory_needs_permission() {
    let mut a = arena();
    let (x, _) = grow(&mut a, 4 * G, L);
    a.put(Block { stream: StreamKey(7), ..x });
    assert!(a.take(4 * G, L, &mut |_, _, _| false).is_none());
    match a.plan(4 * G, L, PlanRules::default(), &mut |_, _, _| false).unwrap() {
        Growth::Window { window, .. } => {
            assert_ne!(window.start, x.addr, "a refused stream's memory is not used");
            assert_eq!(window.targets.len(), 4);
        }
        g => panic!("{g:?}"),
    }
    let y = a.take(4 * G, L, &mut |s, _, _| s == StreamKey(7)).unwrap();
    assert_eq!(y.addr, x.addr);
}

#[test]
fn a_window_over_two_streams_memory_leaves_the_rest_with_its_stream() {
    let mut a = arena();
    let (x, _) = grow(&mut a, 3 * G, L);
    let (y, _) = grow(&mut a, 7 * G, L);
    a.put(Block { stream: StreamKey(1), ..x });
    a.put(Block { stream: StreamKey(3), ..y });
    // No single free block holds 8 granules; the window spans both streams' memory.
    let (z, n) = grow(&mut a, 8 * G, StreamKey(2));
    assert_eq!((z.addr, n), (x.addr, 0));
    let rest: Vec<Block> = a.free_blocks().into_iter().filter(|b| b.addr == x.addr + 8 * G).collect();
    assert_eq!(rest.len(), 1);
    // Stream 2 waited for 1 and 3 before using their memory; the 2 granules it did not
    // take are still 3's: another stream must wait for 3, not for 2, to get them.
    assert_eq!((rest[0].size, rest[0].stream), (2 * G, StreamKey(3)));
}

#[test]
fn a_crumb_takes_only_scraps_beside_live_large_blocks() {
    let mut a = arena();
    // Granules g0 g1 g2: x (3/4 granule) in g0, y (3/4) across g0/g1, z (9/8) across g1/g2,
    // and a scrap of 3/8 granule after z in g2.
    let q = 3 * G / 4;
    let crumb = G / 4;
    assert!(crumb <= super::SMALL_LIMIT && q > super::SMALL_LIMIT);
    let (x, _) = grow(&mut a, q, L);
    let (y, _) = grow(&mut a, q, L);
    let (z, _) = grow(&mut a, 9 * G / 8, L);
    assert_eq!(a.mapped_bytes(), 3 * G);
    // x and y freed on two streams: g0 is wholly free, in two nodes each smaller than a
    // granule. It is no scrap (a loan, a release or a stitch can use it whole).
    a.put(Block { stream: StreamKey(1), ..x });
    a.put(Block { stream: StreamKey(2), ..y });
    let c = a.take_spilled(crumb, L, &mut |_, _, _| true).expect("the scrap after z");
    assert_eq!(c.addr, z.addr + z.size, "the crumb went beside live z");
    // An eighth of a granule is left after it: a second crumb fits only in x's or y's
    // node, whose first bytes lie in g0, which no live block holds.
    assert!(a.take_spilled(crumb, L, &mut |_, _, _| true).is_none(), "a crumb would pin the free granule g0");
    assert!(a.take_spilled(2 * G, L, &mut |_, _, _| true).is_none(), "large requests never spill");
    a.check_invariants().unwrap();
}

#[test]
fn a_granule_shared_by_two_streams_free_blocks_is_released_after_both() {
    let mut a = arena();
    let (x, _) = grow(&mut a, 3 * G / 2, L);
    let (y, _) = grow(&mut a, 3 * G / 2, L);
    a.put(x);
    a.put(Block { stream: StreamKey(9), ..y });
    a.check_invariants().unwrap();
    let runs = a.releasable(ReleaseOrder::OldestFirst);
    assert_eq!(runs.len(), 1);
    assert_eq!((runs[0].addr, runs[0].len), (x.addr, 3 * G), "granule 1 holds both blocks' ends");
    assert_eq!(runs[0].streams, vec![L, StreamKey(9)]);
    a.unmapped(runs[0].addr, runs[0].len);
    a.check_invariants().unwrap();
    assert_eq!(a.mapped_bytes(), 0);
}

#[test]
fn release_lists_whole_free_granules_only() {
    let mut a = arena();
    let (x, _) = grow(&mut a, 3 * G / 2, L); // granules 0-1, x ends mid-granule 1
    let (y, _) = grow(&mut a, 3 * G, L); // from x's end: granules 1-4 (2-4 new)
    assert_eq!((y.addr, a.mapped_bytes()), (x.addr + x.size, 5 * G));
    a.put(y);
    // Granule 1 is shared with the live x: only granules 2-4 can go back.
    let runs = a.releasable(ReleaseOrder::LargestFirst);
    assert_eq!(runs.iter().map(|r| (r.addr, r.len, r.streams.clone())).collect::<Vec<_>>(), vec![(x.addr + 2 * G, 3 * G, vec![L])]);
    for r in runs {
        a.unmapped(r.addr, r.len);
    }
    a.check_invariants().unwrap();
    assert_eq!(a.mapped_bytes(), 2 * G);
    assert_eq!(a.cached_bytes(), G / 2);
}

#[test]
fn stitches_in_use_or_broken_bound_what_eviction_could_make_room_for() {
    let g = 2 << 20;
    let mut st = stitch::Stitches::new(0x1000_0000, 16 * g);
    let a = st.add(st.find_va(4 * g).unwrap(), (0..4).map(|i| 0x9000_0000 + i * g).collect(), g);
    let b = st.add(st.find_va(6 * g).unwrap(), (4..10).map(|i| 0x9000_0000 + i * g).collect(), g);
    assert!(st.could_hold(16 * g), "free stitches can all be evicted");
    assert!(!st.could_hold(16 * g + 1), "past the range");
    st.get_mut(a).in_use = true;
    assert!(st.could_hold(12 * g) && !st.could_hold(12 * g + 1), "a stitch in use keeps its 4 granules");
    st.get_mut(b).broken = true;
    assert!(st.could_hold(6 * g) && !st.could_hold(6 * g + 1), "a broken one is never evicted either");
}

#[test]
fn a_crumb_takes_a_scrap_before_planning_only_where_planning_could_not_do_better() {
    // z (9/8 granule) leaves a scrap of 7/8 granule in g1, which a live block also holds.
    let mut a = arena();
    let (z, _) = grow(&mut a, 9 * G / 8, L);
    let crumb = G / 8;
    assert!(a.take_spilled_unplanned(2 * G, L, &mut |_, _, _| true).is_none(), "large requests never spill");
    // The small range has no free memory: the crumb goes beside z with no plan.
    let c = a.take_spilled_unplanned(crumb, L, &mut |_, _, _| true).expect("the scrap beside z");
    assert_eq!(c.addr, z.addr + z.size);
    a.put(c);
    // Small-range free memory of two streams in neighbouring nodes may make a window with no
    // new memory that `take` cannot see as one block: planning goes first then.
    let (s1, _) = grow(&mut a, 64 << 10, L);
    let keep = grow(&mut a, 64 << 10, L).0;
    let c = a.take_spilled_unplanned(crumb, L, &mut |_, _, _| true).expect("one stream's free memory (the small granule's rest): the scrap first");
    a.put(c);
    a.put(Block { stream: StreamKey(1), ..s1 });
    assert!(a.take_spilled_unplanned(crumb, L, &mut |_, _, _| true).is_none(), "two streams' free memory: plan first");
    let _ = keep;
    a.check_invariants().unwrap();
}

#[test]
fn while_shards_contend_small_requests_get_new_memory_instead_of_a_new_stitch() {
    let mut a = arena();
    // Eight 2-granule blocks, free every other one: 8 granules free, no 3 in a row.
    let blocks: Vec<Block> = (0..8).map(|_| grow(&mut a, 2 * G, L).0).collect();
    for b in blocks.iter().step_by(2) {
        a.put(*b);
    }
    let contended = PlanRules { small_stitches: false, ..PlanRules::default() };
    let mapped = a.mapped_bytes();
    // Three granules: new memory (a window past the live blocks), no stitch.
    let (small, n) = grow_under(&mut a, 3 * G, L, contended);
    assert_eq!((n, a.counters.stitches_made), (3, 0));
    assert_eq!(a.mapped_bytes(), mapped + 3 * G);
    // CONTENDED_STITCH_FROM granules exactly: new memory too.
    let (edge, n) = grow_under(&mut a, CONTENDED_STITCH_FROM * G, L, contended);
    assert_eq!((n, a.counters.stitches_made), (CONTENDED_STITCH_FROM, 0));
    a.put(edge);
    // More than CONTENDED_STITCH_FROM granules are still stitched from the free ones.
    let (big, aliased) = grow_under(&mut a, (CONTENDED_STITCH_FROM + 1) * G, L, contended);
    assert_eq!((aliased, a.counters.stitches_made), (CONTENDED_STITCH_FROM + 1, 1));
    assert_eq!(a.mapped_bytes(), mapped + (3 + CONTENDED_STITCH_FROM) * G, "no new memory for the stitch");
    a.put(small);
    a.put(big);
    a.check_invariants().unwrap();
}

#[test]
fn with_piece_ends_a_full_stitch_cache_takes_a_window_where_only_pieces_would_stitch() {
    // Four blocks of 1.5 granules side by side, the second and fourth freed: granules 2 and
    // 5 whole free, the free end of granule 1 beside a live block, and the range's end free.
    let setup = || {
        let mut a = ArenaStrategy::new((1 << 40, 64 * G), (2 << 40, 256 * G), (3 << 40, 1024 * G), G);
        a.set_piece_ends(true);
        let blocks: Vec<Block> = (0..4).map(|_| grow(&mut a, G + G / 2, L).0).collect();
        a.put(blocks[1]);
        a.put(blocks[3]);
        (a, blocks)
    };
    // Two and a half granules: a stitch of the piece and the two whole granules needs no new
    // memory; without the piece, a stitch and a window at the range's end each need one.
    let (a, _) = setup();
    match a.plan(2 * G + G / 2, L, PlanRules::default(), &mut |_, _, _| true).unwrap() {
        Growth::Stitch { head, fresh, .. } => assert_eq!((head, fresh.len()), (G / 2, 0), "a stitch that begins in the piece"),
        other => panic!("expected a pieced stitch, got {other:?}"),
    }
    // With the stitch cache full, making that stitch would evict a cached one (which may be
    // free whole again, where a pieced one seldom is): the window is taken instead.
    let (mut a, blocks) = setup();
    while a.stitches.count() < stitch::MAX_STITCHES {
        let base = a.stitches.find_va(G).expect("stitch address space");
        a.add_stitch(base, vec![blocks[0].addr]);
    }
    a.check_invariants().unwrap();
    match a.plan(2 * G + G / 2, L, PlanRules::default(), &mut |_, _, _| true).unwrap() {
        Growth::Window { window, .. } => assert_eq!(window.targets.len(), 1, "one new granule at the range's end"),
        other => panic!("expected a window, got {other:?}"),
    }
}
