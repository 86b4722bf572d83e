//! Where an arena's memory lies at each new peak of what it maps, for a `GPUPOOL_TRACE`
//! replayed on the simulated device: live bytes and free mapped bytes of its small and large
//! ranges, and, just before the growth, what its free memory could have offered: whole free
//! granules (what a stitch can move, and a loan where lending is on) and free bytes in
//! pieces of granules (usable only in place). `cargo run --release --example arena_peak -- trace.csv [--no-arena-lend]`
use gpupool::config::PoolKind;
use gpupool::pool::{Pool, PoolOptions};
use gpupool::replay::parse;
use gpupool::strategy::arena::SMALL_LIMIT;
use gpupool::trace::Action;
use gpupool::upstream::sim::SimUpstream;
use std::collections::HashMap;

fn main() {
    let path = std::env::args().nth(1).expect("usage: arena_peak TRACE.csv");
    let ops = parse(&std::fs::read_to_string(&path).expect("readable trace")).expect("a trace");
    let arena_lend = !std::env::args().any(|a| a == "--no-arena-lend");
    let opts = PoolOptions { kind: PoolKind::Arena, arena_lend, ..Default::default() };
    let mut pool = Pool::new(0, Box::new(SimUpstream::with_pages(80 << 30, false)), &opts).expect("pool");
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    // The simulated device's granule, as the H100's and H200's.
    const GRANULE: usize = 2 << 20;
    let (mut live, mut peak_mapped, mut peak_live) = (HashMap::new(), 0usize, 0usize);
    let (mut small_live, mut large_live) = (0usize, 0usize);
    for (i, op) in ops.iter().enumerate() {
        match op.action {
            Action::Alloc => {
                let before = pool.stats().total_bytes as usize;
                let free = free_granules(&pool, GRANULE);
                let p = pool.malloc(op.size, op.stream).expect("malloc");
                let grew = (pool.stats().total_bytes as usize).saturating_sub(before);
                if grew > 0 && before + grew > peak_mapped {
                    let (whole, pieces, piece_bytes, largest) = free;
                    println!(
                        "  before op {i}: {:.2} MiB asked, grew {:.1} MiB; free: {whole} whole granules, {:.1} MiB in {pieces} pieces of granules, largest block {:.1} MiB",
                        mib(op.size), mib(grew), mib(piece_bytes), mib(largest)
                    );
                }
                live.insert(op.ptr, (p, op.size));
                if op.size <= SMALL_LIMIT { small_live += op.size } else { large_live += op.size }
            }
            Action::Free => {
                if let Some((p, n)) = live.remove(&op.ptr) {
                    pool.free(p, op.stream).expect("free");
                    if n <= SMALL_LIMIT { small_live -= n } else { large_live -= n }
                }
            }
            _ => {}
        }
        peak_live = peak_live.max(small_live + large_live);
        let mapped = pool.stats().total_bytes as usize;
        if mapped > peak_mapped {
            peak_mapped = mapped;
            let f = pool.arena_figures().expect("arena");
            let u = [f.small, f.large];
            println!(
                "op {i:>8}: {} {:>7.2} MiB -> mapped {:>7.1} MiB (small {:>6.1} mapped, {:>6.1} free; large {:>6.1} mapped, {:>6.1} free) live small {:>6.1} large {:>6.1} peak live {:>6.1}",
                if op.action == Action::Alloc { "alloc" } else { "free " },
                mib(op.size), mib(mapped), mib(u[0].0), mib(u[0].1), mib(u[1].0), mib(u[1].1), mib(small_live), mib(large_live), mib(peak_live)
            );
        }
    }
    println!("peak mapped {:.1} MiB, peak live (requested) {:.1} MiB: {:.3}", mib(peak_mapped), mib(peak_live), peak_mapped as f64 / peak_live as f64);
}

/// The pool's free memory as a stitch sees it: whole free granules, the free blocks that
/// hold bytes outside whole granules and those bytes, and the largest free block.
fn free_granules(pool: &Pool, g: usize) -> (usize, usize, usize, usize) {
    let (mut whole, mut pieces, mut piece_bytes, mut largest) = (0, 0, 0, 0);
    for b in pool.free_blocks() {
        let n = ((b.addr + b.size) / g).saturating_sub(b.addr.div_ceil(g));
        whole += n;
        if b.size > n * g {
            pieces += 1;
            piece_bytes += b.size - n * g;
        }
        largest = largest.max(b.size);
    }
    (whole, pieces, piece_bytes, largest)
}
