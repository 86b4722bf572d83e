//! Peak reserved over the peak of bytes requested (rounded to 512 B), for a `GPUPOOL_TRACE`
//! replayed through the arena on the simulated device; the pool's own peak of bytes in use
//! beside it. `cargo run --release --example honest_peak -- TRACE.csv...`
use gpupool::config::PoolKind;
use gpupool::pool::{Pool, PoolOptions};
use gpupool::replay::parse;
use gpupool::trace::Action;
use gpupool::upstream::sim::SimUpstream;
use std::collections::HashMap;

fn main() {
    for path in std::env::args().skip(1) {
        let ops = parse(&std::fs::read_to_string(&path).expect("readable trace")).expect("a trace");
        let opts = PoolOptions { kind: PoolKind::Arena, ..Default::default() };
        let mut pool = Pool::new(0, Box::new(SimUpstream::with_pages(80 << 30, false)), &opts).expect("pool");
        let (mut live, mut cur, mut peak_live, mut peak_mapped) = (HashMap::new(), 0usize, 0usize, 0usize);
        for op in &ops {
            match op.action {
                Action::Alloc => {
                    let p = pool.malloc(op.size, op.stream).expect("malloc");
                    let n = op.size.div_ceil(512) * 512;
                    live.insert(op.ptr, (p, n));
                    cur += n;
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
        let s = pool.stats();
        println!("{path} {peak_mapped} {peak_live} {:.4} pool_peak_used {} {:.4}", peak_mapped as f64 / peak_live as f64, s.peak_used_bytes, peak_mapped as f64 / s.peak_used_bytes as f64);
    }
}
