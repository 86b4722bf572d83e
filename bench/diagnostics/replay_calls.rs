//! Replay a GPUPOOL_TRACE through one strategy on the simulated device and print every
//! operation that made driver calls: where a pool stops being steady.
//! `cargo run --release --example replay_calls -- TRACE.csv [POOL]`
use gpupool::config::PoolKind;
use gpupool::replay::parse;
use gpupool::trace::Action;
use gpupool::upstream::sim::SimUpstream;
use gpupool::{Pool, PoolOptions};
use std::collections::HashMap;

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args.next().expect("usage: replay_calls TRACE.csv [POOL]");
    let kind = args.next().and_then(|s| PoolKind::parse(&s)).unwrap_or(PoolKind::Arena);
    let ops = parse(&std::fs::read_to_string(path).expect("readable trace")).expect("a trace");
    let opts = PoolOptions { kind, thread_cache: false, ..Default::default() };
    let mut p = Pool::new(0, Box::new(SimUpstream::new(80 << 30)), &opts).unwrap();
    let mut map = HashMap::new();
    for (i, op) in ops.iter().enumerate() {
        let before = p.driver_calls().total();
        let (cached, largest) = { let s = p.stats(); (s.free_bytes, s.largest_free_block) };
        match op.action {
            Action::Alloc => {
                if let Ok(a) = p.malloc(op.size, op.stream) {
                    map.insert(op.ptr, a);
                }
            }
            Action::Free => {
                if let Some(a) = map.remove(&op.ptr) {
                    p.free(a, op.stream).unwrap();
                }
            }
            _ => {}
        }
        let d = p.driver_calls().total() - before;
        if d > 0 {
            println!("op {i}/{}: alloc {} MiB -> {d} calls (cached {} MiB, largest free {} MiB, {:?})", ops.len(), op.size >> 20, cached >> 20, largest >> 20, p.arena_figures().map(|f| f.counters));
        }
    }
}
