//! What the arena tests (`arena`, `arena_chunks`, `arena_model`) share: the granule of the
//! host upstream's simulated VMM, and a pool on the host upstream with the invariant scan on
//! after every operation and no thread cache.
#![allow(dead_code)] // each test crate uses part of it

use crate::common::MIB;
use gpupool::config::PoolKind;
use gpupool::upstream::host::HostUpstream;
use gpupool::{Pool, PoolOptions};

pub const G: usize = 2 * MIB;

pub fn pool(kind: PoolKind, capacity: usize) -> Pool {
    let opts = PoolOptions { kind, check_invariants: true, thread_cache: false, ..Default::default() };
    Pool::new(0, Box::new(HostUpstream::new(capacity)), &opts).unwrap()
}
