//! Faults: an upstream that fails driver calls on a schedule (every Nth call of a kind, or
//! a seeded random one), under every strategy. Every failure must come back as a clear
//! error, the pool's books must stay exact (its invariant scan runs after every operation),
//! no block may be handed out twice or lost, and once the faults stop everything works and
//! all memory goes back. The arena's virtual memory calls fail at random points inside them
//! (a granule's creation, map or access grant, an alias's map or grant, an unmap, a release
//! after a successful unmap, an alias's removal), and after every operation its books must
//! agree with what the host upstream really maps: nothing handed out unmapped, nothing
//! mapped over memory still mapped. Also: a panic inside a pool stops that pool instead of
//! letting it hand out memory from half-updated books.

#[macro_use]
mod common;

use common::{intact, stamp, MIB};

fn check(a: usize, n: usize, id: u64) {
    assert!(intact(a, n, id), "block {a:#x}+{n} was written by someone else");
}
use gpupool::config::PoolKind;
use gpupool::error::{Error, Result};
use gpupool::stream::StreamHandle;
use gpupool::upstream::host::HostUpstream;
use gpupool::upstream::host::HOST_PAGE;
use gpupool::upstream::{AliasFail, AllocError, EventHandle, UnmapFail, Upstream};
use std::collections::HashSet;
use gpupool::{Pool, PoolOptions};
use std::sync::{Arc, Mutex};

/// Which calls fail: each kind fails every `every`-th call when set, and every call fails
/// with probability `1/random` from the seeded generator when set (`vmm_only`: only the
/// virtual memory calls). Also what the host really maps, kept after every such call.
#[derive(Default)]
struct Schedule {
    every: u64,
    random: u64,
    rng: u64,
    calls: u64,
    injected: u64,
    off: bool,
    vmm_only: bool,
    /// Granules that show memory now (homes and aliases), and the bytes of the homes: what
    /// the arena's books must agree with.
    real: HashSet<usize>,
    real_home_bytes: usize,
    /// Maps the pool asked for over memory still mapped (must never happen).
    violations: Vec<String>,
    /// Granules unmapped whose release was made to fail (their memory "leaked").
    leaks: u64,
}

impl Schedule {
    fn dice(&mut self) -> u64 {
        // xorshift64*: a fixed seed gives a reproducible schedule.
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn fail_any(&mut self) -> bool {
        if self.off {
            return false;
        }
        self.calls += 1;
        let by_count = self.every != 0 && self.calls % self.every == 0;
        let by_dice = self.random != 0 && self.dice() % self.random == 0;
        let f = by_count || by_dice;
        self.injected += f as u64;
        f
    }

    /// Whether this (non-VMM) call fails.
    fn fail(&mut self) -> bool {
        !self.vmm_only && self.fail_any()
    }

    /// A position in `0..n`, where a failing call fails.
    fn position(&mut self, n: usize) -> usize {
        (self.dice() % n.max(1) as u64) as usize
    }
}

struct FaultyUpstream {
    host: HostUpstream,
    s: Arc<Mutex<Schedule>>,
    next_event: usize,
}

fn injected(what: &str) -> Error {
    Error::Cuda { call: "injected", code: 999, name: what.to_string() }
}

impl FaultyUpstream {
    fn fail(&self) -> bool {
        self.s.lock().unwrap().fail()
    }

    /// Whether this VMM call fails, and if so where in its `n` steps.
    fn fail_vmm(&self, n: usize) -> Option<usize> {
        let mut s = self.s.lock().unwrap();
        s.fail_any().then(|| s.position(n))
    }

    /// Note what the host really maps in `[addr, addr + len)` after a VMM call.
    fn sync(&self, addr: usize, len: usize) {
        let mut s = self.s.lock().unwrap();
        for g in (addr..addr + len).step_by(HOST_PAGE) {
            if self.host.vmm_is_mapped(g) {
                s.real.insert(g);
            } else {
                s.real.remove(&g);
            }
        }
        s.real_home_bytes = self.host.vmm_mapped_bytes();
    }

    /// The pool must never map over memory still mapped: the driver would refuse, and books
    /// that allow it are wrong.
    fn expect_unmapped(&self, addr: usize, len: usize, what: &str) {
        let mut s = self.s.lock().unwrap();
        if let Some(g) = (addr..addr + len).step_by(HOST_PAGE).find(|g| s.real.contains(g)) {
            s.violations.push(format!("{what} over {g:#x}, which is mapped"));
        }
    }
}

impl Upstream for FaultyUpstream {
    fn name(&self) -> &'static str {
        "faulty-host"
    }
    fn allocate(&mut self, size: usize, st: StreamHandle) -> std::result::Result<usize, AllocError> {
        if self.fail() {
            // Half the failures look like out of memory (the pool escalates), half like a
            // broken driver (reported as is).
            return Err(if size % 2 == 0 { AllocError::OutOfMemory } else { AllocError::Other(injected("allocate")) });
        }
        self.host.allocate(size, st)
    }
    fn deallocate(&mut self, a: usize, size: usize, st: StreamHandle) -> Result<()> {
        if self.fail() {
            return Err(injected("deallocate"));
        }
        self.host.deallocate(a, size, st)
    }
    fn mem_info(&mut self) -> Result<(usize, usize)> {
        self.host.mem_info()
    }
    fn event_create(&mut self) -> Result<EventHandle> {
        if self.fail() {
            return Err(injected("event create"));
        }
        self.next_event += 1;
        Ok(self.next_event)
    }
    fn event_record(&mut self, _ev: EventHandle, _s: StreamHandle) -> Result<()> {
        if self.fail() {
            return Err(injected("event record"));
        }
        Ok(())
    }
    fn event_query(&mut self, _ev: EventHandle) -> Result<bool> {
        if self.fail() {
            return Err(injected("event query"));
        }
        // Busy while faults are injected (cross-stream reuse must wait), idle after.
        Ok(self.s.lock().unwrap().off)
    }
    fn event_synchronize(&mut self, _ev: EventHandle) -> Result<()> {
        if self.fail() {
            return Err(injected("event synchronize"));
        }
        Ok(())
    }
    fn stream_wait_event(&mut self, _s: StreamHandle, _ev: EventHandle) -> Result<()> {
        if self.fail() {
            return Err(injected("stream wait"));
        }
        Ok(())
    }
    fn synchronize_device(&mut self) -> Result<()> {
        if self.fail() {
            return Err(injected("device synchronize"));
        }
        Ok(())
    }
    host_address_space!();
    fn vmm_map_new(&mut self, addr: usize, len: usize) -> std::result::Result<(), AllocError> {
        self.expect_unmapped(addr, len, "map");
        let n = len / HOST_PAGE;
        // Granule k's creation (an even k: out of memory), its map, or the access grant
        // over all of them (k = n) fails; the upstream undoes what it mapped (all or nothing).
        if let Some(k) = self.fail_vmm(2 * n + 1) {
            if k / 2 > 0 && self.host.vmm_map_new(addr, k / 2 * HOST_PAGE).is_ok() {
                let _ = self.host.vmm_unmap(addr, k / 2 * HOST_PAGE);
            }
            return Err(match k {
                k if k == 2 * n => AllocError::Other(injected("set access")),
                k if k % 2 == 0 => AllocError::OutOfMemory,
                _ => AllocError::Other(injected("map")),
            });
        }
        let r = self.host.vmm_map_new(addr, len);
        self.sync(addr, len);
        r
    }
    fn vmm_unmap(&mut self, addr: usize, len: usize) -> std::result::Result<(), UnmapFail> {
        let n = len / HOST_PAGE;
        // Granule k's unmap fails (it stays mapped), or its unmap succeeds and the release
        // of its memory fails (its address is gone, its memory leaked); the ones before it
        // are gone.
        let r = match self.fail_vmm(2 * n) {
            None => self.host.vmm_unmap(addr, len),
            Some(k) => {
                let before = k / 2 * HOST_PAGE;
                match self.host.vmm_unmap(addr, before) {
                    Err(f) => Err(f),
                    Ok(()) if k % 2 == 0 => Err(UnmapFail { unmapped: before, leaked: 0, error: injected("unmap") }),
                    Ok(()) => match self.host.vmm_unmap(addr + before, HOST_PAGE) {
                        Err(f) => Err(UnmapFail { unmapped: before + f.unmapped, ..f }),
                        Ok(()) => {
                            self.s.lock().unwrap().leaks += 1;
                            Err(UnmapFail { unmapped: before + HOST_PAGE, leaked: HOST_PAGE, error: injected("release") })
                        }
                    },
                }
            }
        };
        self.sync(addr, len);
        r
    }
    fn vmm_alias(&mut self, homes: &[usize], to: usize) -> std::result::Result<(), AliasFail> {
        self.expect_unmapped(to, homes.len() * HOST_PAGE, "alias");
        // The map of alias `made` fails, or (made = all) the access grant over them, which
        // leaves them all in place.
        let r = match self.fail_vmm(homes.len() + 1) {
            None => self.host.vmm_alias(homes, to),
            Some(made) => match self.host.vmm_alias(&homes[..made], to) {
                Err(f) => Err(f),
                Ok(()) => Err(AliasFail { made, error: injected(if made == homes.len() { "alias access" } else { "alias" }) }),
            },
        };
        self.sync(to, homes.len() * HOST_PAGE);
        r
    }
    fn vmm_unalias(&mut self, addr: usize, len: usize) -> Result<()> {
        if self.fail_vmm(1).is_some() {
            return Err(injected("unalias"));
        }
        let r = self.host.vmm_unalias(addr, len);
        self.sync(addr, len);
        r
    }
}

const STREAMS: [StreamHandle; 3] = [0, 0xA00, 0xB00];

/// The arena's books against what the host really maps (after operation `i`): the same
/// bytes of memory mapped, and the pool never asked to map over mapped memory.
fn books_agree(p: &Pool, s: &Mutex<Schedule>, i: usize) {
    let s = s.lock().unwrap();
    assert!(s.violations.is_empty(), "operation {i}: {:?}", s.violations);
    let books = p.arena_figures().expect("an arena pool").mapped;
    assert_eq!(books, s.real_home_bytes, "operation {i}: the arena books {books} bytes mapped, the host maps {}", s.real_home_bytes);
}

/// Random operations under `schedule` (`vmm_only`: only the virtual memory calls fail);
/// returns (operations, faults injected).
fn churn(kind: PoolKind, every: u64, random: u64, seed: u64, ops: usize, vmm_only: bool) -> (usize, u64) {
    let s = Arc::new(Mutex::new(Schedule { every, random, rng: seed | 1, vmm_only, ..Default::default() }));
    let up = FaultyUpstream { host: HostUpstream::new(256 * MIB), s: s.clone(), next_event: 0 };
    let opts = PoolOptions { kind, check_invariants: true, ..Default::default() };
    let mut p = match Pool::new(0, Box::new(up), &opts) {
        Ok(p) => p,
        Err(e) => panic!("{kind:?}: pool creation failed without faults: {e}"),
    };
    let mut rng = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407) | 1;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    // Live blocks: (addr, size, stream, stamp id).
    let mut live: Vec<(usize, usize, StreamHandle, u64)> = Vec::new();
    for i in 0..ops {
        let r = next();
        let stream = STREAMS[(r >> 8) as usize % 3];
        match r % 10 {
            0..=4 => {
                let size = match (r >> 16) % 3 {
                    0 => 1 + (r >> 24) as usize % 4096,
                    1 => 4096 + (r >> 24) as usize % (2 * MIB),
                    _ => 2 * MIB + (r >> 24) as usize % (12 * MIB),
                };
                match p.malloc(size, stream) {
                    Ok(a) => {
                        for &(b, n, _, _) in &live {
                            assert!(a + size <= b || b + n <= a, "{kind:?}: block {a:#x}+{size} handed out over live {b:#x}+{n}");
                        }
                        if kind == PoolKind::Arena {
                            let g = s.lock().unwrap();
                            let first = a & !(HOST_PAGE - 1);
                            if let Some(u) = (first..a + size).step_by(HOST_PAGE).find(|u| !g.real.contains(u)) {
                                panic!("operation {i}: block {a:#x}+{size} handed out over the unmapped granule {u:#x}");
                            }
                        }
                        stamp(a, size, i as u64);
                        live.push((a, size, stream, i as u64));
                    }
                    Err(Error::OutOfMemory(_)) | Err(Error::Cuda { .. }) | Err(Error::Internal(_)) => {}
                    Err(e) => panic!("{kind:?}: unexpected error kind {e}"),
                }
            }
            5..=7 if !live.is_empty() => {
                let (a, n, st, id) = live.swap_remove((r >> 20) as usize % live.len());
                check(a, n, id);
                match p.free(a, st) {
                    Ok(()) => {}
                    // A free that failed changed nothing: the block is still the caller's.
                    Err(e) => {
                        assert!(matches!(e, Error::Cuda { .. } | Error::Internal(_)), "{kind:?}: {e}");
                        live.push((a, n, st, id));
                    }
                }
            }
            8 if !live.is_empty() => {
                let (a, ..) = live[(r >> 20) as usize % live.len()];
                let _ = p.record_stream(a, STREAMS[(r >> 40) as usize % 3]);
            }
            9 => match (r >> 12) % 3 {
                0 => {
                    let _ = p.reclaim();
                }
                1 => {
                    let _ = p.set_limit(if (r >> 30) % 2 == 0 { 0 } else { 96 * MIB });
                }
                _ => {
                    let _ = p.set_limit(0);
                }
            },
            _ => {}
        }
        if kind == PoolKind::Arena {
            books_agree(&p, &s, i);
        }
    }
    // Faults stop: everything works and everything goes back.
    let (faults, leaks) = {
        let mut g = s.lock().unwrap();
        g.off = true;
        (g.injected, g.leaks)
    };
    p.set_limit(0).unwrap();
    for (a, n, st, id) in live.drain(..) {
        check(a, n, id);
        p.free(a, st).unwrap_or_else(|e| panic!("{kind:?}: free after the faults failed: {e}"));
    }
    let x = p.malloc(64 * MIB, 0xA00).unwrap_or_else(|e| panic!("{kind:?}: allocation after the faults failed: {e}"));
    p.free(x, 0xA00).unwrap();
    p.reclaim().unwrap();
    p.check_invariants().unwrap();
    assert_eq!(p.used_bytes(), 0, "{kind:?}: bytes still counted in use");
    assert_eq!(p.reserved_bytes(), 0, "{kind:?}: memory lost: {} bytes still reserved after freeing all and reclaiming", p.reserved_bytes());
    if kind == PoolKind::Arena {
        books_agree(&p, &s, ops);
        // Each granule whose release failed is reported as leaked, exactly.
        let leaked = p.arena_figures().unwrap().leaked;
        assert_eq!(leaked, leaks as usize * HOST_PAGE, "granules leaked: {leaks} injected, {leaked} bytes reported");
    }
    (ops, faults)
}

const KINDS: [PoolKind; 4] = [PoolKind::Split, PoolKind::Binned, PoolKind::None, PoolKind::Arena];

#[test]
fn every_nth_call_failing_loses_nothing() {
    for kind in KINDS {
        let mut total = 0;
        for every in [2, 3, 7, 13] {
            total += churn(kind, every, 0, every, 4_000, false).1;
        }
        println!("{kind:?}: {total} faults injected (every 2nd/3rd/7th/13th call), survived");
        assert!(total > 100, "{kind:?}: the schedule injected almost nothing ({total})");
    }
}

#[test]
fn seeded_random_faults_lose_nothing() {
    let ops: usize = std::env::var("GPUPOOL_FAULT_OPS").ok().and_then(|v| v.parse().ok()).unwrap_or(20_000);
    for kind in KINDS {
        let mut total = 0;
        for seed in 1..=4u64 {
            total += churn(kind, 0, 5, seed * 7919, ops / 4, false).1;
        }
        println!("{kind:?}: {ops} operations, {total} random faults injected, survived");
        assert!(total > 50, "{kind:?}: {total}");
    }
}

/// Only the arena's virtual memory calls fail (at random points inside them), often, so
/// failures land on every path that maps, aliases, unmaps and removes aliases; after every
/// operation the books agree with what is mapped (`churn`). A tenth of `GPUPOOL_FAULT_OPS`.
#[test]
fn arena_books_stay_exact_when_virtual_memory_calls_fail() {
    let ops: usize = std::env::var("GPUPOOL_FAULT_OPS").ok().and_then(|v| v.parse().ok()).unwrap_or(20_000) / 10;
    let mut total = 0;
    for (seed, random) in [(11u64, 3u64), (13, 4), (17, 6), (19, 10)] {
        total += churn(PoolKind::Arena, 0, random, seed * 7919, ops.max(4_000) / 4, true).1;
    }
    println!("Arena: {total} virtual memory calls failed, books exact throughout");
    assert!(total > 100, "the schedule injected almost nothing ({total})");
}

#[test]
fn a_panic_inside_a_pool_stops_it_and_it_says_why() {
    use gpupool::ffi::core::*;
    use std::ffi::{c_char, c_void, CStr};
    use std::ptr::null_mut;
    let dev = 9;
    assert_eq!(unsafe { gpupool_configure(dev, c"split".as_ptr(), c"host".as_ptr()) }, gpupool::Status::Ok);
    let mut p: *mut c_void = null_mut();
    assert_eq!(unsafe { gpupool_malloc(&mut p, MIB, dev, null_mut()) }, gpupool::Status::Ok);
    // An operation panics half-way while holding the pool's lock.
    let r = std::panic::catch_unwind(|| {
        let _ = gpupool::registry::with_pool(dev, |_pool| -> gpupool::error::Result<()> { panic!("injected panic inside the pool") });
    });
    assert!(r.is_err());
    let mut q: *mut c_void = null_mut();
    assert_eq!(unsafe { gpupool_malloc(&mut q, MIB, dev, null_mut()) }, gpupool::Status::Stopped);
    let n = unsafe { gpupool_last_error(null_mut(), 0) };
    let mut buf = vec![0u8; n + 1];
    unsafe { gpupool_last_error(buf.as_mut_ptr() as *mut c_char, buf.len()) };
    let msg = CStr::from_bytes_until_nul(&buf).unwrap().to_str().unwrap().to_string();
    assert!(msg.contains("stopped after an internal error"), "{msg}");
    assert!(q.is_null());
    assert_eq!(unsafe { gpupool_free(p, dev, null_mut()) }, gpupool::Status::Stopped, "frees are refused too");
    let n = unsafe { gpupool_memory_status(dev, null_mut(), 0) };
    let mut buf = vec![0u8; n + 1];
    unsafe { gpupool_memory_status(dev, buf.as_mut_ptr() as *mut c_char, buf.len()) };
    let status = CStr::from_bytes_until_nul(&buf).unwrap().to_str().unwrap().to_string();
    assert!(status.contains("STOPPED"), "{status}");
    // Other devices are unaffected.
    assert_eq!(unsafe { gpupool_configure(10, c"split".as_ptr(), c"host".as_ptr()) }, gpupool::Status::Ok);
    assert_eq!(unsafe { gpupool_malloc(&mut q, MIB, 10, null_mut()) }, gpupool::Status::Ok);
    assert_eq!(unsafe { gpupool_free(q, 10, null_mut()) }, gpupool::Status::Ok);
}
