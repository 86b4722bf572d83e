//! Property test: random sequences of malloc / free / reclaim / set_limit on every strategy
//! against a simple reference model (the set of live blocks and their sizes). The pool's own
//! invariant scan runs after every operation; the model checks what a user can observe.

mod common;

use common::*;
use gpupool::config::PoolKind;
use gpupool::error::Error;
use proptest::prelude::*;

const CAPACITY: usize = 96 * MIB;

#[derive(Clone, Debug)]
enum Op {
    Malloc(usize),
    Free(usize),
    Reclaim,
    SetLimit(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => prop_oneof![1usize..4096, 4096usize..(2 * MIB), (2 * MIB)..(24 * MIB)].prop_map(Op::Malloc),
        4 => any::<usize>().prop_map(Op::Free),
        1 => Just(Op::Reclaim),
        1 => prop_oneof![Just(0usize), (8 * MIB)..(80 * MIB)].prop_map(Op::SetLimit),
    ]
}

fn run(kind: PoolKind, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut p = host_pool(kind, CAPACITY);
    // Model: live blocks (addr, requested size, id), and the limit.
    let mut live: Vec<(usize, usize, u64)> = Vec::new();
    let mut limit = 0usize;
    for (id, op) in ops.into_iter().enumerate() {
        match op {
            Op::Malloc(size) => match p.malloc(size, 0) {
                Ok(a) => {
                    prop_assert!(a % 256 == 0);
                    stamp(a, size, id as u64);
                    live.push((a, size, id as u64));
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
                    let (a, s, i) = live.swap_remove(pick % live.len());
                    prop_assert!(intact(a, s, i), "block {a:#x} was overwritten");
                    p.free(a, 0).map_err(|e| TestCaseError::fail(e.to_string()))?;
                    prop_assert!(p.free(a, 0).is_err(), "double free accepted");
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
    for (a, s, i) in live {
        prop_assert!(intact(a, s, i));
        p.free(a, 0).unwrap();
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
