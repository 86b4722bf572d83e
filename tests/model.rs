//! Property test: random sequences of malloc / free / reclaim / set_limit on every strategy
//! against a simple reference model (the set of live blocks and their sizes). The pool's own
//! invariant scan runs after every operation; the model checks what a user can observe.

mod common;

use common::*;
use gpupool::config::PoolKind;
use gpupool::error::Error;
use proptest::prelude::*;

const CAPACITY: usize = 96 * MIB;

/// Streams the operations use: the legacy default stream and two user streams.
const STREAMS: [usize; 3] = [0, 0xA00, 0xB00];

#[derive(Clone, Debug)]
enum Op {
    /// Size, and the stream (index into `STREAMS`).
    Malloc(usize, usize),
    Free(usize),
    /// A live block (picked) is also used on a stream (index).
    RecordStream(usize, usize),
    Reclaim,
    SetLimit(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (prop_oneof![1usize..4096, 4096usize..(2 * MIB), (2 * MIB)..(24 * MIB)], 0usize..3).prop_map(|(s, st)| Op::Malloc(s, st)),
        4 => any::<usize>().prop_map(Op::Free),
        1 => (any::<usize>(), 0usize..3).prop_map(|(p, st)| Op::RecordStream(p, st)),
        1 => Just(Op::Reclaim),
        1 => prop_oneof![Just(0usize), (8 * MIB)..(80 * MIB)].prop_map(Op::SetLimit),
    ]
}

fn run(kind: PoolKind, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut p = host_pool(kind, CAPACITY);
    // Model: live blocks (addr, requested size, id, stream), and the limit.
    let mut live: Vec<(usize, usize, u64, usize)> = Vec::new();
    let mut limit = 0usize;
    for (id, op) in ops.into_iter().enumerate() {
        match op {
            Op::Malloc(size, st) => match p.malloc(size, STREAMS[st]) {
                Ok(a) => {
                    prop_assert!(a % 256 == 0);
                    for &(b, n, _, _) in &live {
                        prop_assert!(a + size <= b || b + n <= a, "block {a:#x}+{size} overlaps live {b:#x}+{n}");
                    }
                    stamp(a, size, id as u64);
                    live.push((a, size, id as u64, STREAMS[st]));
                }
                Err(Error::OutOfMemory(r)) => {
                    // Legitimate only if even a minimal segment cannot fit after the pool
                    // released everything it could.
                    let cap = if limit == 0 { CAPACITY } else { limit.min(CAPACITY) };
                    prop_assert!(
                        r.reserved + r.rounded > cap,
                        "spurious OOM: reserved {} + {} <= {cap} ({kind:?})",
                        r.reserved,
                        r.rounded
                    );
                }
                Err(e) => return Err(TestCaseError::fail(format!("unexpected error {e}"))),
            },
            Op::Free(pick) => {
                if live.is_empty() {
                    prop_assert!(p.free(0x1000 + pick % 4096 * 256, 0).is_err(), "unknown pointer accepted");
                } else {
                    let (a, s, i, st) = live.swap_remove(pick % live.len());
                    prop_assert!(intact(a, s, i), "block {a:#x} was overwritten");
                    p.free(a, st).map_err(|e| TestCaseError::fail(e.to_string()))?;
                    prop_assert!(p.free(a, st).is_err(), "double free accepted");
                }
            }
            Op::RecordStream(pick, st) => {
                if let Some(&(a, ..)) = live.get(pick % live.len().max(1)) {
                    p.record_stream(a, STREAMS[st]).map_err(|e| TestCaseError::fail(e.to_string()))?;
                }
            }
            Op::Reclaim => {
                let before = p.stats();
                let n = p.reclaim().unwrap();
                let after = p.stats();
                prop_assert_eq!(after.total_bytes, before.total_bytes - n as u64);
                if live.is_empty() {
                    prop_assert_eq!(after.total_bytes, 0);
                }
            }
            Op::SetLimit(l) => {
                limit = l;
                p.set_limit(l).unwrap();
            }
        }
        let st = p.stats();
        prop_assert_eq!(st.n_live_blocks as usize, live.len());
        prop_assert_eq!(st.requested_bytes as usize, live.iter().map(|l| l.1).sum::<usize>());
        prop_assert!(st.total_bytes as usize <= CAPACITY);
        prop_assert_eq!(st.used_bytes + st.free_bytes, st.total_bytes);
    }
    for (a, s, i, st) in live {
        prop_assert!(intact(a, s, i));
        p.free(a, st).unwrap();
    }
    p.reclaim().unwrap();
    prop_assert_eq!(p.stats().total_bytes, 0);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]
    #[test]
    fn split_matches_model(ops in prop::collection::vec(op(), 1..120)) { run(PoolKind::Split, ops)? }
    #[test]
    fn binned_matches_model(ops in prop::collection::vec(op(), 1..120)) { run(PoolKind::Binned, ops)? }
    #[test]
    fn none_matches_model(ops in prop::collection::vec(op(), 1..120)) { run(PoolKind::None, ops)? }
}

/// A seeded sequence of `n` operations with the same mix as `op()` (for the long run, which
/// is too long for proptest's shrinking: a failure prints its seed and length, and the short
/// proptest runs above shrink the same kinds of sequences).
fn seeded_ops(seed: u64, n: usize) -> Vec<Op> {
    let mut x = seed | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    (0..n)
        .map(|_| {
            let r = next();
            let st = (r >> 40) as usize % 3;
            match r % 13 {
                0..=5 => Op::Malloc(
                    match (r >> 8) % 3 {
                        0 => 1 + (r >> 16) as usize % 4095,
                        1 => 4096 + (r >> 16) as usize % (2 * MIB - 4096),
                        _ => 2 * MIB + (r >> 16) as usize % (22 * MIB),
                    },
                    st,
                ),
                6..=9 => Op::Free((r >> 8) as usize),
                10 => Op::RecordStream((r >> 8) as usize, st),
                11 => Op::Reclaim,
                _ => Op::SetLimit(if (r >> 8) % 2 == 0 { 0 } else { 8 * MIB + (r >> 16) as usize % (72 * MIB) }),
            }
        })
        .collect()
}

/// The long model check: `GPUPOOL_MODEL_OPS` operations per strategy (CI runs 1,000,000;
/// the default `cargo test` 30,000), in chunks of 10,000 from successive seeds, each chunk
/// starting from a fresh pool and ending with everything freed and reclaimed.
#[test]
fn long_random_sequences_match_the_model() {
    let total: usize = std::env::var("GPUPOOL_MODEL_OPS").ok().and_then(|v| v.parse().ok()).unwrap_or(30_000);
    for kind in [PoolKind::Split, PoolKind::Binned, PoolKind::None] {
        let mut done = 0;
        let mut seed = 1u64;
        while done < total {
            let n = (total - done).min(10_000);
            if let Err(e) = run(kind, seeded_ops(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15), n)) {
                panic!("{kind:?}: seed {seed}, {n} operations: {e}");
            }
            done += n;
            seed += 1;
        }
        println!("{kind:?}: {done} operations matched the model");
    }
}
