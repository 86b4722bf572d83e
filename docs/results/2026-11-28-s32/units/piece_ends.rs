//! Session 32 estimate (an example while it ran: copy to examples/ and
//! `cargo run --release --example piece_ends -- TRACE.csv`): how much new memory the arena's
//! growths of large requests could save if a stitch's first and last granules could be
//! granules partly in use, the block using only their free part (the free tail of one
//! granule, the free head of another). For each large request that grew, the best such pair
//! anywhere in the large range is taken, which bounds the saving from above (later growths
//! are not replayed with the saving, and a window growth already uses its neighbour's piece).
//! Ran against 3489d87's parent (the pool's peak in use then counted stitched blocks whole;
//! the peak live here is the trace's own).
use gpupool::config::PoolKind;
use gpupool::pool::{Pool, PoolOptions};
use gpupool::replay::parse;
use gpupool::strategy::arena::SMALL_LIMIT;
use gpupool::trace::Action;
use gpupool::upstream::sim::SimUpstream;
use std::collections::HashMap;

fn main() {
    let path = std::env::args().nth(1).expect("usage: piece_ends TRACE.csv");
    let ops = parse(&std::fs::read_to_string(&path).expect("readable trace")).expect("a trace");
    let opts = PoolOptions { kind: PoolKind::Arena, ..Default::default() };
    let mut pool = Pool::new(0, Box::new(SimUpstream::with_pages(80 << 30, false)), &opts).expect("pool");
    const G: usize = 2 << 20;
    let mut live = HashMap::new();
    let mut large_seg = None;
    let mut stitch_growths = 0usize;
    let (mut grew_total, mut growths, mut save_total, mut save_stitched) = (0usize, 0usize, 0usize, 0usize);
    let (mut cur, mut peak_live, mut peak_mapped) = (0usize, 0usize, 0usize);
    for op in &ops {
        match op.action {
            Action::Alloc => {
                let before = pool.stats().total_bytes as usize;
                let (mut h, mut t) = (0usize, 0usize);
                if let Some(seg) = large_seg {
                    for b in pool.free_blocks().iter().filter(|b| b.segment == seg) {
                        let (a, e) = (b.addr, b.end());
                        let up = a.div_ceil(G) * G;
                        if a % G != 0 && e >= up {
                            h = h.max(up - a);
                        }
                        let down = e / G * G;
                        if e % G != 0 && a <= down {
                            t = t.max(e - down);
                        }
                    }
                }
                let made = pool.arena_counters().expect("arena").stitches_made;
                let p = pool.malloc(op.size, op.stream).expect("malloc");
                let stitched = pool.arena_counters().expect("arena").stitches_made > made;
                if large_seg.is_none() && op.size > SMALL_LIMIT {
                    large_seg = pool.free_blocks().iter().map(|b| b.segment).find(|&s| s <= p && p < s + (1 << 40));
                }
                let grew = (pool.stats().total_bytes as usize).saturating_sub(before);
                if grew > 0 && op.size > SMALL_LIMIT {
                    growths += 1;
                    grew_total += grew;
                    let need = op.size.div_ceil(G);
                    let with = op.size.saturating_sub(h + t).div_ceil(G);
                    let save = (need.saturating_sub(with) * G).min(grew);
                    save_total += save;
                    if stitched {
                        save_stitched += save;
                        stitch_growths += 1;
                    }
                }
                live.insert(op.ptr, (p, op.size));
                cur += op.size;
            }
            Action::Free => {
                if let Some((p, n)) = live.remove(&op.ptr) {
                    pool.free(p, op.stream).expect("free");
                    cur -= n;
                }
            }
            _ => {}
        }
        peak_live = peak_live.max(cur);
        peak_mapped = peak_mapped.max(pool.stats().total_bytes as usize);
    }
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    println!(
        "peak mapped {:.1} MiB / peak live {:.1} MiB = {:.4}; large growths {growths}, new {:.1} MiB; pieces at both ends would save at most {:.1} MiB ({:.1} in the {stitch_growths} that stitched): {:.4} if all were saved, {:.4} if the stitches' were",
        mib(peak_mapped), mib(peak_live), peak_mapped as f64 / peak_live as f64, mib(grew_total), mib(save_total), mib(save_stitched),
        (peak_mapped - save_total) as f64 / peak_live as f64, (peak_mapped - save_stitched) as f64 / peak_live as f64
    );
}
