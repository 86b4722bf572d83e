//! A transformer training loop's allocations, simulated on the replay's device (no GPU):
//! per step a random sequence length, forward activations kept for backward, temporaries,
//! backward gradients, optimizer state. Prints, per strategy, peak reserved / peak in use
//! and the driver calls of the steps after warm-up: the CPU stand-in for the training row
//! of `bench/workloads/bench_workloads.py`, for trying arena policies between GPU runs.
//!
//! ```text
//! cargo run --release --example training_steps [STEPS]
//! ```

use gpupool::config::PoolKind;
use gpupool::upstream::sim::SimUpstream;
use gpupool::{Pool, PoolOptions};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

const B: usize = 8;
const D: usize = 1024;
const H: usize = 16;
const LAYERS: usize = 8;
const VOCAB: usize = 32000;
const F32: usize = 4;

/// One step at sequence length `t`: returns nothing; every block it allocates is freed.
fn step(p: &mut Pool, t: usize) {
    let act = B * t * D * F32;
    let mut saved: Vec<Vec<usize>> = Vec::new();
    let alloc = |p: &mut Pool, n: usize| p.malloc(n, 0).expect("simulated device is large enough");
    let tokens = alloc(p, B * t * 8);
    let mut x = alloc(p, act);
    for _ in 0..LAYERS {
        let ln = alloc(p, act);
        let qkv = alloc(p, 3 * act);
        let scores = alloc(p, B * H * t * t * F32);
        let probs = alloc(p, B * H * t * t * F32);
        p.free(scores, 0).unwrap();
        let attn = alloc(p, act);
        let proj = alloc(p, act);
        let x2 = alloc(p, act);
        p.free(proj, 0).unwrap();
        let ln2 = alloc(p, act);
        let up = alloc(p, 4 * act);
        let gelu = alloc(p, 4 * act);
        let down = alloc(p, act);
        let x3 = alloc(p, act);
        p.free(down, 0).unwrap();
        saved.push(vec![x, ln, qkv, probs, attn, x2, ln2, up, gelu]);
        x = x3;
    }
    let logits = alloc(p, B * t * VOCAB * F32);
    let grad_logits = alloc(p, B * t * VOCAB * F32);
    p.free(logits, 0).unwrap();
    let mut grad = alloc(p, act);
    p.free(grad_logits, 0).unwrap();
    p.free(x, 0).unwrap();
    for layer in saved.into_iter().rev() {
        // Gradients of the layer's temporaries, then its saved tensors go.
        let g_up = alloc(p, 4 * act);
        let g_gelu = alloc(p, 4 * act);
        let g_scores = alloc(p, B * H * t * t * F32);
        let g_probs = alloc(p, B * H * t * t * F32);
        p.free(g_scores, 0).unwrap();
        let g_qkv = alloc(p, 3 * act);
        p.free(g_up, 0).unwrap();
        p.free(g_gelu, 0).unwrap();
        p.free(g_probs, 0).unwrap();
        let g_x = alloc(p, act);
        p.free(g_qkv, 0).unwrap();
        p.free(grad, 0).unwrap();
        grad = g_x;
        for a in layer {
            p.free(a, 0).unwrap();
        }
    }
    p.free(grad, 0).unwrap();
    p.free(tokens, 0).unwrap();
}

fn main() {
    let steps: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(50);
    let warmup = 10;
    println!("| strategy | peak reserved / peak in use | driver calls per step after warm-up | memory calls per step |");
    println!("|---|---|---|---|");
    for kind in [PoolKind::Split, PoolKind::Arena] {
        let opts = PoolOptions { kind, thread_cache: false, ..Default::default() };
        let mut p = Pool::new(0, Box::new(SimUpstream::new(640 << 30)), &opts).unwrap();
        // Parameters, gradients and two AdamW moments: persistent.
        let params: Vec<usize> = (0..4 * LAYERS * 4).map(|i| p.malloc(if i % 4 == 0 { 4 * D * D * F32 } else { D * D * F32 }, 0).unwrap()).collect();
        let mut rng = Rng(42);
        let mut calls_at_warm = None;
        for i in 0..warmup + steps {
            if i == warmup {
                calls_at_warm = Some(p.driver_calls());
            }
            let t = if i == 0 { 2048 } else { 128 + (rng.next() % 31) as usize * 64 };
            step(&mut p, t);
        }
        let (c0, c1) = (calls_at_warm.unwrap(), p.driver_calls());
        let s = p.stats();
        println!(
            "| {} | {:.3} | {:.1} | {:.1} |",
            p.strategy_name(),
            s.peak_total_bytes as f64 / s.peak_used_bytes as f64,
            (c1.total() - c0.total()) as f64 / steps as f64,
            (c1.memory_calls() - c0.memory_calls()) as f64 / steps as f64
        );
        if let Some(c) = p.arena_figures().map(|f| f.counters) {
            println!("  arena: {c:?}");
        }
        for a in params {
            p.free(a, 0).unwrap();
        }
    }
}
