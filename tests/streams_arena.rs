//! The stream rule for the arena's granules, against the busy device of `streams_support/`:
//! free granules of one stream stitched into a block for another, lent to the other range,
//! the rest of a lent granule passed on to a third stream, and a loan ended under pressure,
//! each only after the receiving stream waited for the work of the streams that used the
//! memory before (`streams.rs` has the rule for every pool).

#[macro_use]
mod common;
mod streams_support;

use common::MIB;
use gpupool::config::PoolKind;
use gpupool::upstream::host::HostUpstream;
use gpupool::{Pool, PoolOptions};
use std::sync::Arc;
use streams_support::*;

#[test]
fn arena_stitches_another_streams_free_granules_only_after_waiting_for_it() {
    let (mut p, dev) = pool(PoolKind::Arena, false);
    assert_eq!(p.strategy_name(), "arena");
    // Four 4 MiB blocks on A; free the 1st and 3rd: 8 MiB free, no 8 MiB in a row.
    let blocks: Vec<usize> = (0..4).map(|_| p.malloc(4 * MIB, A).unwrap()).collect();
    p.free(blocks[0], A).unwrap();
    p.free(blocks[2], A).unwrap();
    log(&dev);
    let reserved = p.stats().total_bytes;
    let big = p.malloc(8 * MIB, B).unwrap();
    assert_eq!(p.stats().total_bytes, reserved, "the free granules were stitched: nothing new mapped");
    let l = log(&dev);
    let wait = l.iter().position(|x| x.starts_with(&format!("wait {B:#x}"))).expect("B waited for A's frees");
    let alias = l.iter().position(|x| x.starts_with("alias")).expect("granules aliased");
    assert!(wait < alias, "handed to B before B waited for A: {l:?}");
    p.free(big, B).unwrap();
    // The stitch is cached: A gets it again after waiting for B, with no new alias.
    log(&dev);
    let again = p.malloc(8 * MIB, A).unwrap();
    assert_eq!(again, big);
    let l = log(&dev);
    assert!(l.iter().any(|x| x.starts_with(&format!("wait {A:#x}"))), "{l:?}");
    assert!(!l.iter().any(|x| x.starts_with("alias")), "{l:?}");
}

#[test]
fn arena_lends_another_streams_free_granule_to_the_other_range_only_after_waiting_for_it() {
    let (mut p, dev) = pool(PoolKind::Arena, false);
    // A frees a large block's granule; B's small blocks then need a granule of the small
    // range, which shows A's free one instead of new memory: B must wait for A first.
    let x = p.malloc(2 * MIB, A).unwrap();
    p.free(x, A).unwrap();
    log(&dev);
    let reserved = p.stats().total_bytes;
    let s = p.malloc(MIB / 2, B).unwrap();
    assert_eq!(p.stats().total_bytes, reserved, "no new memory");
    let l = log(&dev);
    let wait = l.iter().position(|x| x.starts_with(&format!("wait {B:#x}"))).unwrap_or_else(|| panic!("B waited for A: {l:?}"));
    let alias = l.iter().position(|x| x.starts_with("alias")).unwrap_or_else(|| panic!("aliased: {l:?}"));
    assert!(wait < alias, "lent to B before B waited for A: {l:?}");
    p.free(s, B).unwrap();
    p.check_invariants().unwrap();

    // With batched records a pending free is not lent to another stream at all.
    let (mut p, dev) = batched(PoolKind::Arena);
    let x = p.malloc(2 * MIB, A).unwrap();
    p.free(x, A).unwrap();
    let reserved = p.stats().total_bytes;
    let s = p.malloc(MIB / 2, B).unwrap();
    assert!(p.stats().total_bytes > reserved, "A's pending granule was lent to B");
    assert!(!log(&dev).iter().any(|x| x.starts_with("alias")));
    p.free(s, B).unwrap();
    p.check_invariants().unwrap();
}

#[test]
fn the_rest_of_a_lent_granule_goes_to_a_third_stream_only_after_waiting() {
    // B's small block takes a quarter of a granule lent from A's free large one (B waited on
    // A); the rest is booked free on B. C taking it must wait on an event B recorded after
    // that wait, or it could use memory A's kernels still touch.
    let (mut p, dev) = pool(PoolKind::Arena, false);
    let x = p.malloc(2 * MIB, A).unwrap();
    p.free(x, A).unwrap();
    let s = p.malloc(MIB / 2, B).unwrap();
    assert_eq!(p.arena_figures().unwrap().counters.granules_lent, 1);
    let l = log(&dev);
    let wait = l.iter().position(|x| x.starts_with(&format!("wait {B:#x}"))).unwrap_or_else(|| panic!("{l:?}"));
    let rec = l.iter().rposition(|x| x.starts_with("record") && x.ends_with(&format!("on {B:#x}"))).unwrap_or_else(|| panic!("B recorded after the loan: {l:?}"));
    assert!(wait < rec, "{l:?}");
    let reserved = p.stats().total_bytes;
    let t = p.malloc(MIB / 2, C).unwrap();
    assert_eq!(p.stats().total_bytes, reserved, "C took the rest of the lent granule");
    let l = log(&dev);
    assert!(l.iter().any(|x| x.starts_with(&format!("wait {C:#x}"))), "C did not wait: {l:?}");
    p.free(s, B).unwrap();
    p.free(t, C).unwrap();
    p.check_invariants().unwrap();
}

#[test]
fn a_loan_ended_under_pressure_gives_its_home_back_only_after_its_users_work() {
    // A window of the large range lends a small-range granule A freed (A busy), then needs
    // new memory the limit refuses: the escalation releases cached memory, ending the loan.
    // The home goes back to the driver only after A's work on it was waited for.
    let dev = Arc::new(Device::default());
    let up = BusyUpstream { host: HostUpstream::new(1 << 30), dev: dev.clone(), next_event: 0 };
    let opts = PoolOptions { kind: PoolKind::Arena, check_invariants: true, event_batch: 1, arena_lend: true, ..Default::default() };
    let mut p = Pool::new(0, Box::new(up), &opts).unwrap();
    let smalls: Vec<usize> = (0..4).map(|_| p.malloc(MIB / 2, A).unwrap()).collect();
    for s in smalls {
        p.free(s, A).unwrap();
    }
    p.set_limit(2 * MIB).unwrap();
    let before = log(&dev);
    let a_ev = before.iter().rev().find(|x| x.ends_with(&format!("on {A:#x}"))).unwrap().split(' ').nth(1).unwrap().to_string();
    let _ = p.malloc(4 * MIB, B);
    let l = log(&dev);
    if let Some(u) = l.iter().position(|x| x.starts_with("unmap")) {
        // Waited for A directly, for the device, or for an event B recorded after B was
        // made to wait on A.
        let direct = l[..u].iter().any(|x| *x == format!("sync {a_ev}") || x == "device sync");
        let via_b = l[..u].iter().position(|x| *x == format!("wait {B:#x} on {a_ev}")).is_some_and(|w| {
            l[w..u].iter().filter(|x| x.starts_with("record") && x.ends_with(&format!("on {B:#x}"))).any(|r| {
                let ev = r.split(' ').nth(1).unwrap();
                l[w..u].iter().any(|x| *x == format!("sync {ev}"))
            })
        });
        assert!(direct || via_b, "A's former granule went back before A's work was waited for: {l:?}");
    }
    p.check_invariants().unwrap();
}

/// An arena over the busy device with batched records (the default) and decay on.
fn decaying_arena() -> (Pool, Arc<streams_support::Device>) {
    let dev = Arc::new(streams_support::Device::default());
    let up = BusyUpstream { host: HostUpstream::new(1 << 30), dev: dev.clone(), next_event: 0 };
    let opts = PoolOptions { kind: PoolKind::Arena, check_invariants: true, decay_window: 8, ..Default::default() };
    (Pool::new(0, Box::new(up), &opts).unwrap(), dev)
}

#[test]
fn a_decay_trim_before_an_arena_growth_waits_for_the_requesters_own_frees_with_its_event() {
    // Batched records (the default): A's frees wait for its next record. A growth whose
    // decay trim gives them back covers them first with A's event, so the trim waits on
    // that event, not on the whole device.
    let (mut p, dev) = decaying_arena();
    let a = p.malloc(8 * MIB, A).unwrap();
    p.free(a, A).unwrap();
    for _ in 0..64 {
        // Decay's recent peak falls to these small blocks' size.
        let s = p.malloc(4096, A).unwrap();
        p.free(s, A).unwrap();
    }
    log(&dev);
    let big = p.malloc(16 * MIB, A).unwrap();
    let l = log(&dev);
    let unmap = l.iter().position(|x| x.starts_with("unmap")).expect("the trim gave memory back");
    let record = l.iter().position(|x| x.starts_with("record") && x.ends_with(&format!("on {A:#x}"))).expect("A's frees recorded");
    assert!(record < unmap, "{l:?}");
    assert!(!l.iter().any(|x| x == "device sync"), "a device-wide wait for A's own frees: {l:?}");
    p.free(big, A).unwrap();
}

#[test]
fn the_decay_trim_of_an_allocation_waits_for_the_allocating_streams_own_frees_with_its_event() {
    // Decay also trims once an epoch inside an allocation, not only before a growth.
    let (mut p, dev) = decaying_arena();
    let a = p.malloc(8 * MIB, A).unwrap();
    p.free(a, A).unwrap();
    log(&dev);
    for _ in 0..64 {
        let s = p.malloc(4096, A).unwrap();
        p.free(s, A).unwrap();
    }
    let l = log(&dev);
    assert!(l.iter().any(|x| x.starts_with("unmap")), "the trim gave memory back: {l:?}");
    assert!(!l.iter().any(|x| x == "device sync"), "a device-wide wait for A's own frees: {l:?}");
}

/// A loan whose alias could be neither granted nor removed (quarantined) books its home for
/// the borrowing stream, which had waited for the home's stream first. When the alias goes
/// and the home is free again, a third stream that takes it must wait for that work too:
/// the borrower records its event after the wait, as a loan does.
#[test]
fn a_quarantined_loans_home_reaches_a_third_stream_only_after_the_work_before_it() {
    const D: usize = 0xD00;
    let (mut p, dev) = pool(PoolKind::Arena, false);
    let a = p.malloc(2 * MIB, A).unwrap();
    let _keep = p.malloc(2 * MIB, A).unwrap();
    let b = p.malloc(4 * MIB, B).unwrap();
    p.free(a, A).unwrap();
    p.free(b, B).unwrap();
    // C's small request borrows a free large granule; the grant fails and so does the undo.
    dev.fail_next_alias.store(true, std::sync::atomic::Ordering::SeqCst);
    dev.unalias_failures.store(1, std::sync::atomic::Ordering::SeqCst);
    assert!(p.malloc(512 * 1024, C).is_err());
    // A pass of releases removes the stale alias (the home is free again) and gives B's
    // run back; the quarantined home stays mapped.
    p.set_limit(6 * MIB).unwrap();
    p.set_limit(0).unwrap();
    p.check_invariants().unwrap();
    // The release's waits made the device idle; work is queued again (A's may be among it,
    // as far as the pool can tell from C's side).
    dev.idle.store(false, std::sync::atomic::Ordering::SeqCst);
    log(&dev);
    let got = p.malloc(2 * MIB, D).unwrap();
    let l = log(&dev);
    if got == a {
        assert!(l.iter().any(|e| e.starts_with(&format!("wait {D:#x}"))), "D took the home of the quarantined loan with no wait: {l:?}");
    }
    p.check_invariants().unwrap();
}

/// The requester's own small-range free memory is all `take` needs to look at before a
/// scrap is taken unplanned; free memory of another stream is planned around first, where
/// a window of it that needs no new memory may be reusable where its best fit is not.
#[test]
fn a_crumb_uses_another_streams_reusable_small_memory_before_a_scrap() {
    // Batched event records: A's free below has no event yet, so it is not reusable by B.
    let (mut p, dev) = batched(PoolKind::Arena);
    let a = p.malloc(64 * 1024, A).unwrap();
    let _live = p.malloc(64 * 1024, A).unwrap();
    let big = p.malloc(2 * MIB + 256 * 1024, 0).unwrap();
    p.free(a, A).unwrap(); // pending on A, with no event: A's best fit is not reusable by B
    log(&dev);
    let got = p.malloc(64 * 1024, B).unwrap();
    let small_granule = a & !(2 * MIB - 1);
    assert!(got >= small_granule && got < small_granule + 2 * MIB, "the crumb went to the large range's scrap at {got:#x} (big at {big:#x})");
    p.check_invariants().unwrap();
}
