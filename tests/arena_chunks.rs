//! The arena's chunks, on the host upstream's simulated VMM: a long growth is mapped as a
//! few large allocations rather than granule by granule, which are stitched, released and
//! exported whole (and a strict export is refused where other blocks live in the chunk); no
//! chunk is larger than the largest, near the device's memory growth maps granules, and
//! chunks can be turned off.

mod common;
mod arena_support;

use arena_support::{pool, G};
use common::{intact, stamp, MIB};
use gpupool::config::PoolKind;
use gpupool::upstream::host::HostUpstream;
use gpupool::{Pool, PoolOptions};

#[test]
fn a_long_growth_is_mapped_in_chunks_which_are_stitched_and_released_whole() {
    let mut p = pool(PoolKind::Arena, 2 << 30);
    // 256 MiB of new memory: two chunks of 128 MiB (half the run), one create + one map
    // each and one access grant per chunk, not 128 of each.
    let before = p.driver_calls();
    let a1 = p.malloc(256 * MIB, 0).unwrap();
    let d = p.driver_calls();
    assert_eq!((d.mem_create - before.mem_create, d.mem_map - before.mem_map), (2, 2), "{}", d.text());
    // The reports show them.
    assert!(p.stats_json().contains("\"chunks\":2,\"chunk_bytes\":268435456,"), "{}", p.stats_json());
    assert!(p.memory_status().contains("256.00 MiB of it in 2 chunks"), "{}", p.memory_status());
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
    assert_eq!(p.arena_figures().unwrap().counters.stitches_made, 1);
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
    assert!(p.stats_json().contains("\"chunks\":0,\"chunk_bytes\":0,"), "{}", p.stats_json());
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
    // The importer maps the chunk whole and would see `y` too: a strict export is refused,
    // one that shares granules goes, listing the whole chunk.
    let e = p.ipc_export(x, false).unwrap_err().to_string();
    assert!(e.contains("shares its"), "{e}");
    let len = p.ipc_export(x, true).unwrap().len();
    assert_eq!(len, gpupool::share::protocol::HEADER_BYTES + granules * gpupool::share::protocol::GRANULE_BYTES, "the whole chunk is listed");
    // `y` starts past the chunk's first granule: its descriptor says so, and an importer
    // maps the chunk and finds `y` at that offset.
    stamp(y, 4 * MIB, 4);
    let dy = gpupool::share::protocol::GranuleDescriptor::decode(&p.ipc_export(y, true).unwrap()).unwrap();
    assert_eq!((dy.offset as usize, dy.granules.len()), (y - a, granules));
    let fds: Vec<i32> = dy.granules.iter().map(|s| s.fd).collect();
    let at = p.importer().import(&dy, Some(&fds)).unwrap();
    assert!(intact(at, 4 * MIB, 4), "the import shows y's bytes");
    p.importer().close(at).unwrap();
    p.free(y, 0).unwrap();
    stamp(x, 4 * MIB, 3);
    let desc = p.ipc_export(x, false).unwrap();
    let d = gpupool::share::protocol::GranuleDescriptor::decode(&desc).unwrap();
    assert_eq!((d.granules.len(), d.offset), (granules, 0));
    // The rest of the chunk is set aside while `x` lives: a new block goes elsewhere.
    let z = p.malloc(4 * MIB, 0).unwrap();
    assert!(z >= a + 128 * MIB, "not in the exported chunk");
    // The importer maps the chunk and sees the block's bytes.
    let fds: Vec<i32> = d.granules.iter().map(|s| s.fd).collect();
    let at = p.importer().import(&d, Some(&fds)).unwrap();
    assert!(intact(at, 4 * MIB, 3), "the import shows the exported bytes");
    p.importer().close(at).unwrap();
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
fn a_lower_chunk_threshold_maps_shorter_growths_as_chunks() {
    // 16 MiB is under the default threshold (64 MiB): eight granules. With the threshold at
    // 8 MiB, the same growth is two chunks of 8 MiB (half the run).
    let mut p = pool(PoolKind::Arena, 1 << 30);
    let before = p.driver_calls();
    let a = p.malloc(16 * MIB, 0).unwrap();
    assert_eq!(p.driver_calls().mem_create - before.mem_create, 8, "{}", p.driver_calls().text());
    p.free(a, 0).unwrap();
    let opts = PoolOptions { kind: PoolKind::Arena, check_invariants: true, thread_cache: false, arena_chunk_from: 8 * MIB, ..Default::default() };
    let mut p = Pool::new(0, Box::new(HostUpstream::new(1 << 30)), &opts).unwrap();
    let before = p.driver_calls();
    let a = p.malloc(16 * MIB, 0).unwrap();
    let d = p.driver_calls();
    assert_eq!((d.mem_create - before.mem_create, d.mem_map - before.mem_map), (2, 2), "{}", d.text());
    // A growth of exactly the threshold is chunked (two of 4 MiB); a shorter one, 6 MiB,
    // stays three granules.
    let before = p.driver_calls();
    let b = p.malloc(8 * MIB, 0).unwrap();
    assert_eq!(p.driver_calls().mem_create - before.mem_create, 2, "{}", p.driver_calls().text());
    let before = p.driver_calls();
    let c = p.malloc(6 * MIB, 0).unwrap();
    assert_eq!(p.driver_calls().mem_create - before.mem_create, 3, "{}", p.driver_calls().text());
    stamp(a, 16 * MIB, 3);
    stamp(b, 8 * MIB, 4);
    stamp(c, 6 * MIB, 5);
    assert!(intact(a, 16 * MIB, 3) && intact(b, 8 * MIB, 4) && intact(c, 6 * MIB, 5));
    for x in [a, b, c] {
        p.free(x, 0).unwrap();
    }
    p.check_invariants().unwrap();
}

#[test]
fn no_chunk_is_larger_than_the_largest_and_near_the_devices_memory_growth_maps_granules() {
    // 600 MiB: three equal chunks (200 MiB each), none over the largest (256 MiB).
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
