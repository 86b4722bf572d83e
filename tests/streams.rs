//! The stream rule on CPU, against an upstream whose "device" is busy until the test says
//! otherwise (`streams_support/`): a block freed on stream A reaches stream B only after B
//! waited on A's event (or the event completed); `record_stream` defers the free; frees with
//! no stream are reused only after a fence on the legacy stream. Then the batched event
//! records of user-stream frees: one record per batch, batches that grow while no other
//! stream asks, and a pending free reaching another stream only after its stream's next
//! record. The arena's stitches and loans across streams are in `streams_arena.rs`; the GPU
//! stress test proves the same on real hardware.

#[macro_use]
mod common;
mod streams_support;

use common::MIB;
use gpupool::config::PoolKind;
use gpupool::pool::FreeOn;
use gpupool::stream::STREAM_LEGACY;
use gpupool::{Pool, PoolOptions};
use std::sync::atomic::Ordering;
use streams_support::*;

#[test]
fn same_stream_reuse_needs_no_wait() {
    for_caching(|k| {
        let (mut p, dev) = pool(k, false);
        let a = p.malloc(MIB, A).unwrap();
        p.free(a, A).unwrap();
        log(&dev);
        assert_eq!(p.malloc(MIB, A).unwrap(), a);
        assert!(log(&dev).iter().all(|l| !l.starts_with("wait")), "{k:?}: same-stream reuse waited");
    });
}

#[test]
fn cross_stream_reuse_waits_on_the_freeing_streams_event() {
    for_caching(|k| {
        let (mut p, dev) = pool(k, false);
        let a = p.malloc(MIB, A).unwrap();
        p.free(a, A).unwrap();
        let l = log(&dev);
        // The event recorded on A at the free ("record evN on 0xa00") is the one B must wait on.
        let recorded: Vec<String> = l
            .iter()
            .filter(|x| x.starts_with("record") && x.ends_with(&format!("on {A:#x}")))
            .map(|x| x.split(' ').nth(1).unwrap().to_string())
            .collect();
        assert!(!recorded.is_empty(), "{k:?}: free on A records A's event: {l:?}");
        let b = p.malloc(MIB, B).unwrap();
        assert_eq!(b, a, "{k:?}: the cached block is reused (after a wait)");
        let l = log(&dev);
        let last = recorded.last().unwrap();
        assert!(
            l.iter().any(|x| *x == format!("wait {B:#x} on {last}")),
            "{k:?}: B must wait on the event recorded on A ({last}) before reuse, not another: {l:?}"
        );
        assert_eq!(p.stats().n_cross_stream_reuses, 1);
    });
}

#[test]
fn completed_event_allows_reuse_without_wait() {
    for_caching(|k| {
        let (mut p, dev) = pool(k, false);
        let a = p.malloc(MIB, A).unwrap();
        p.free(a, A).unwrap();
        dev.idle.store(true, Ordering::SeqCst);
        log(&dev);
        assert_eq!(p.malloc(MIB, B).unwrap(), a);
        assert!(log(&dev).iter().all(|l| !l.starts_with("wait")));
    });
}

#[test]
fn an_event_seen_complete_is_not_asked_about_again_until_its_stream_records_again() {
    // A stream that stopped freeing (destroyed, or moved to another shard) leaves its cached
    // blocks to the others; each reuse asked the driver about the same finished event.
    for_caching(|k| {
        let (mut p, dev) = pool(k, false);
        let a: Vec<usize> = (0..4).map(|_| p.malloc(MIB, A).unwrap()).collect();
        for &x in &a {
            p.free(x, A).unwrap();
        }
        dev.idle.store(true, Ordering::SeqCst);
        let queries = || dev.queries.load(Ordering::SeqCst);
        let (before, reserved) = (queries(), p.stats().total_bytes);
        let b: Vec<usize> = (0..4).map(|_| p.malloc(MIB, B).unwrap()).collect();
        assert_eq!(p.stats().total_bytes, reserved, "{k:?}: B reused A's memory");
        assert_eq!(queries() - before, 1, "{k:?}: one query for A's event, then none");
        // A records again (a new free): its event must be asked about anew.
        let c = p.malloc(MIB, A).unwrap();
        p.free(c, A).unwrap();
        dev.idle.store(false, Ordering::SeqCst);
        log(&dev);
        let before = queries();
        let d = p.malloc(MIB, B).unwrap();
        assert_eq!(d, c, "{k:?}");
        assert_eq!(queries() - before, 1, "{k:?}");
        assert!(log(&dev).iter().any(|l| l.starts_with(&format!("wait {B:#x}"))), "{k:?}: B waited for A's new record");
        for x in b.into_iter().chain([d]) {
            p.free(x, B).unwrap();
        }
    });
}

#[test]
fn legacy_stream_event_is_recorded_lazily() {
    let (mut p, dev) = pool(PoolKind::Split, false);
    let a = p.malloc(MIB, 0).unwrap();
    p.free(a, 0).unwrap();
    assert!(log(&dev).is_empty(), "the legacy hot path makes no event calls");
    assert_eq!(p.malloc(MIB, 0).unwrap(), a);
    p.free(a, 0).unwrap();
    let b = p.malloc(MIB, B).unwrap();
    assert_eq!(b, a);
    let l = log(&dev);
    assert_eq!(l[0], format!("record ev1 on {STREAM_LEGACY:#x}"), "{l:?}");
    assert!(l[1].starts_with(&format!("wait {B:#x} on ev1")), "{l:?}");
}

#[test]
fn record_stream_defers_the_free_until_that_streams_work_is_done() {
    for_caching(|k| {
        let (mut p, dev) = pool(k, false);
        let a = p.malloc(MIB, A).unwrap();
        p.record_stream(a, B).unwrap();
        p.free(a, A).unwrap();
        assert!(log(&dev).iter().any(|x| x.starts_with("record") && x.ends_with(&format!("on {B:#x}"))));
        // Busy: even stream A may not have it back yet.
        let other = p.malloc(MIB, A).unwrap();
        assert_ne!(other, a, "{k:?}: block reused before B's work finished");
        assert_eq!(p.stats().n_deferred_frees, 1);
        // Double free of a deferred block is still detected.
        assert!(p.free(a, A).is_err());
        dev.idle.store(true, Ordering::SeqCst);
        assert_eq!(p.malloc(MIB, A).unwrap(), a, "{k:?}: after B's event completes the block is back");
    });
}

#[test]
fn ignoring_streams_is_what_the_unsafe_test_switch_does() {
    let (mut p, dev) = pool(PoolKind::Split, true);
    let a = p.malloc(MIB, A).unwrap();
    p.free(a, A).unwrap();
    assert_eq!(p.malloc(MIB, B).unwrap(), a);
    assert!(log(&dev).is_empty(), "no events at all when streams are ignored");
}

#[test]
fn reclaim_synchronises_before_releasing_stream_memory() {
    let (mut p, dev) = pool(PoolKind::Split, false);
    let a = p.malloc(MIB, A).unwrap();
    p.free(a, A).unwrap();
    assert!(!dev.idle.load(Ordering::SeqCst));
    let n = p.reclaim().unwrap();
    assert_eq!(n, 2 * MIB);
    assert!(dev.idle.load(Ordering::SeqCst), "release waited for the stream's event");
}

#[test]
fn stream_less_frees_are_reused_only_after_a_legacy_fence() {
    use gpupool::pool::UNFENCED_MAX_BLOCKS;
    let (mut p, dev) = pool(PoolKind::Split, false);
    let first = p.malloc(MIB, 0).unwrap();
    p.free(first, FreeOn::Unordered).unwrap();
    assert!(log(&dev).is_empty(), "no fence for a single free (they are batched)");
    let second = p.malloc(MIB, 0).unwrap();
    assert_ne!(second, first, "an unfenced block must not be handed out");
    assert!(p.free(first, FreeOn::Unordered).is_err(), "double free of an unfenced block is detected");
    // Fill the batch: the fence is recorded on the legacy stream and the blocks come back.
    let mut more = vec![second];
    for _ in 0..UNFENCED_MAX_BLOCKS - 2 {
        more.push(p.malloc(MIB, 0).unwrap());
    }
    for a in &more {
        p.free(*a, FreeOn::Unordered).unwrap();
    }
    let l = log(&dev);
    assert_eq!(l, vec![format!("record ev1 on {STREAM_LEGACY:#x}")], "one fence for the whole batch");
    let again = p.malloc(MIB, 0).unwrap();
    assert!(more.contains(&again) || again == first, "fenced blocks are reused");
    p.free(again, 0).unwrap();
    assert_eq!(p.stats().used_bytes, 0);
}

#[test]
fn stream_less_frees_stay_unfenced_while_the_fence_cannot_be_recorded() {
    use gpupool::pool::UNFENCED_MAX_BLOCKS;
    for_caching(|kind| {
        let (mut p, dev) = pool(kind, false);
        dev.refuse_records.store(true, Ordering::SeqCst);
        let freed: Vec<usize> = (0..UNFENCED_MAX_BLOCKS).map(|_| p.malloc(MIB, 0).unwrap()).collect();
        for a in &freed {
            p.free(*a, FreeOn::Unordered).unwrap();
        }
        assert!(log(&dev).iter().any(|l| l.ends_with("refused")), "{kind:?}: the full batch tried a fence");
        // No fence: none of them is reused, on the legacy stream or another, before or
        // after pressure (reclaim fences at once, and fails again).
        let mut more = Vec::new();
        for s in [0, A, 0, B] {
            if s == B {
                let _ = p.reclaim();
            }
            for _ in 0..UNFENCED_MAX_BLOCKS / 4 {
                let a = p.malloc(MIB, s).unwrap();
                assert!(!freed.contains(&a), "{kind:?}: {a:#x} reused on {s:#x} though its fence failed");
                more.push((a, s));
            }
        }
        // The driver records again: the next fence (the next allocation's, the batch being
        // full) hands them on.
        dev.refuse_records.store(false, Ordering::SeqCst);
        let a = p.malloc(MIB, 0).unwrap();
        assert!(freed.contains(&a), "{kind:?}: fenced blocks are reused");
        p.free(a, 0).unwrap();
        for (a, s) in more {
            p.free(a, s).unwrap();
        }
        assert_eq!(p.stats().used_bytes, 0);
    });
}

/// Blocks handed from stream to stream through many short-lived streams: each stream's free
/// index empties when the next stream takes its block. The invariant scan (on in these pools)
/// fails if emptied indexes of dead streams pile up instead of being dropped past a few.
#[test]
fn many_short_lived_streams_do_not_accumulate_free_indexes() {
    let (mut p, _dev) = pool(PoolKind::Split, false);
    for i in 0..200usize {
        let s = 0x10_000 + i * 0x100;
        let a = p.malloc(4 * MIB, s).unwrap();
        p.free(a, s).unwrap();
    }
    assert!(p.check_invariants().is_ok());
}

#[test]
fn a_steady_state_on_user_streams_makes_no_driver_call() {
    // Through the C API, whose per-thread fast path serves each stream for itself: once a
    // thread's sizes repeat, its steps on a user stream reach no pool and make no call (the
    // host upstream counts the calls a CUDA upstream would make: stream ids, events, memory).
    use gpupool::ffi::core::{gpupool_configure, gpupool_free, gpupool_malloc};
    use std::ffi::c_void;
    for (d, kind) in [(40, c"split"), (41, c"binned"), (42, c"arena")] {
        assert_eq!(unsafe { gpupool_configure(d, kind.as_ptr(), c"host".as_ptr()) }, gpupool::Status::Ok);
        let s = A as *mut c_void;
        // (One size per step: with several sizes interleaved, a miss returns the thread's
        // kept blocks to the pool, whose frees on a user stream record an event each.)
        let step = || {
            let mut p = std::ptr::null_mut();
            assert_eq!(unsafe { gpupool_malloc(&mut p, 3 * MIB, d, s) }, gpupool::Status::Ok);
            assert_eq!(unsafe { gpupool_free(p, d, s) }, gpupool::Status::Ok);
        };
        for _ in 0..3 {
            step();
        }
        let calls = || gpupool::registry::with_pool(d, |p| Ok(p.driver_calls())).unwrap();
        let before = calls();
        for _ in 0..100 {
            step();
        }
        assert_eq!(calls(), before, "{kind:?}: steady-state steps on a user stream made driver calls");
    }
}

#[test]
fn user_stream_frees_record_one_event_per_batch_and_reuse_needs_none() {
    for_caching(|k| {
        let (mut p, dev) = batched(k);
        let batch = PoolOptions::default().event_batch;
        // Sizes that do not repeat in a row, 8 live at a time, all on A.
        let mut live = std::collections::VecDeque::new();
        let mut step = |p: &mut Pool, i: usize| {
            live.push_back(p.malloc((1 + i % 7) * 64 * 1024, A).unwrap());
            if live.len() > 8 {
                p.free(live.pop_front().unwrap(), A).unwrap();
            }
        };
        // Warm-up: the pool grows (and a growth records the stream's pending frees).
        for i in 0..batch {
            step(&mut p, i);
        }
        log(&dev);
        for i in 0..(4 * batch) {
            step(&mut p, i);
        }
        let l = log(&dev);
        let records = l.iter().filter(|x| x.starts_with("record")).count();
        assert!(records <= 5, "{k:?}: {records} records for {} frees: {l:?}", 4 * batch);
        assert!(records >= 2, "{k:?}: a full batch records: {l:?}");
        assert!(!l.iter().any(|x| x.starts_with("wait") || x.starts_with("sync") || x == "device sync"), "{k:?}: {l:?}");
        for x in std::mem::take(&mut live) {
            p.free(x, A).unwrap();
        }
    });
}

/// Frees on A between A's event records, one small block at a time, for `frees` frees.
fn record_gaps(p: &mut Pool, dev: &Device, frees: usize) -> Vec<usize> {
    let (mut gaps, mut since) = (Vec::new(), 0);
    for _ in 0..frees {
        let x = p.malloc(4096, A).unwrap();
        p.free(x, A).unwrap();
        since += 1;
        if log(dev).iter().any(|l| l.starts_with("record") && l.ends_with(&format!("on {A:#x}"))) {
            gaps.push(std::mem::take(&mut since));
        }
    }
    gaps
}

#[test]
fn a_stream_nobody_borrows_from_records_ever_less_often_until_one_asks() {
    for_caching(|k| {
        let (mut p, dev) = batched(k);
        let batch = PoolOptions::default().event_batch;
        log(&dev);
        let gaps = record_gaps(&mut p, &dev, 47 * batch); // 1 + 2 + 4 + 8 + 16 + 16 batches
        let want: Vec<usize> = [1, 2, 4, 8, 16, 16].iter().map(|m| m * batch).collect();
        assert_eq!(gaps, want, "{k:?}: each unasked batch doubles, up to 16x");
        // B is refused A's pending block: A's next free records at once, and its batch
        // starts over at the configured size.
        let x = p.malloc(MIB, A).unwrap();
        p.free(x, A).unwrap();
        let y = p.malloc(MIB, B).unwrap();
        assert_ne!(x, y, "{k:?}: B got A's pending block");
        let gaps = record_gaps(&mut p, &dev, 2 * batch);
        assert_eq!(gaps[..2], [1, batch], "{k:?}: the refusal's record, then a batch of the configured size");
        p.free(y, B).unwrap();
        p.check_invariants().unwrap();
    });
}

#[test]
fn a_pending_free_goes_to_another_stream_only_after_its_streams_next_record() {
    for_caching(|k| {
        let (mut p, dev) = batched(k);
        let (x, spare) = (p.malloc(MIB, A).unwrap(), p.malloc(MIB, A).unwrap());
        p.free(x, A).unwrap();
        assert!(log(&dev).iter().all(|l| !l.starts_with("record")), "{k:?}: a free is pending, not recorded");
        // A itself reuses it at once, with no call.
        assert_eq!(p.malloc(MIB, A).unwrap(), x, "{k:?}");
        assert!(log(&dev).is_empty(), "{k:?}");
        p.free(x, A).unwrap();
        // B may not: no event covers that free yet, and A's handle may not be used now.
        let y = p.malloc(MIB, B).unwrap();
        assert_ne!(y, x, "{k:?}: B got A's pending block");
        assert!(!log(&dev).iter().any(|l| l.starts_with("wait")), "{k:?}");
        // (y stays live, so B's next request cannot be served by B's own memory.)
        // B was refused, so A's next free records at once, covering x as well...
        p.free(spare, A).unwrap();
        let l = log(&dev);
        let rec = l.iter().find(|x| x.starts_with("record") && x.ends_with(&format!("on {A:#x}"))).unwrap_or_else(|| panic!("{k:?}: {l:?}"));
        let ev = rec.split(' ').nth(1).unwrap().to_string();
        // ...and B now gets A's memory (once its own segment's rest is used) after waiting
        // on that record.
        let mut got = vec![y];
        while !got.contains(&x) && !got.contains(&spare) && got.len() < 64 {
            got.push(p.malloc(MIB, B).unwrap());
        }
        assert!(got.contains(&x) || got.contains(&spare), "{k:?}: B never reused A's covered blocks");
        let l = log(&dev);
        assert!(l.iter().any(|x| *x == format!("wait {B:#x} on {ev}")), "{k:?}: {l:?}");
        for g in got {
            p.free(g, B).unwrap();
        }
        p.check_invariants().unwrap();
    });
}

#[test]
fn releasing_memory_with_pending_frees_waits_for_the_device() {
    // A pending free's stream handle may be dead by the time memory goes back: the release
    // waits for the whole device rather than on a handle or an event that misses it.
    for k in [PoolKind::Split, PoolKind::Binned, PoolKind::Arena] {
        let (mut p, dev) = batched(k);
        let a = p.malloc(MIB, A).unwrap();
        p.free(a, A).unwrap();
        log(&dev);
        assert!(p.reclaim().unwrap() > 0, "{k:?}");
        let l = log(&dev);
        assert!(l.iter().any(|x| x == "device sync"), "{k:?}: {l:?}");
        assert!(!l.iter().any(|x| x.starts_with("record")), "{k:?}: recorded on a stored handle: {l:?}");
        p.check_invariants().unwrap();
    }
}

#[test]
fn none_records_every_free_before_giving_it_back() {
    let (mut p, dev) = batched(PoolKind::None);
    for _ in 0..3 {
        let a = p.malloc(MIB, A).unwrap();
        p.free(a, A).unwrap();
    }
    let l = log(&dev);
    assert_eq!(l.iter().filter(|x| x.starts_with("record")).count(), 3, "{l:?}");
    assert!(!l.iter().any(|x| x == "device sync"), "{l:?}");
}

#[test]
fn another_stream_gets_an_older_covered_block_when_the_best_fit_is_pending() {
    // A's best-fitting free block for B is pending (freed after A's last record), but an
    // older one is covered: B takes the covered one after waiting on A, rather than growing.
    let (mut p, dev) = batched(PoolKind::Split);
    let x = p.malloc(3 * MIB, A).unwrap();
    let z = p.malloc(3 * MIB, A).unwrap(); // live: keeps x and y apart
    let y = p.malloc(2 * MIB, A).unwrap();
    let w = p.malloc(3 * MIB, A).unwrap(); // live: keeps y apart from the segment's rest
    p.free(x, A).unwrap();
    let big = p.malloc(64 * MIB, A).unwrap(); // a growth on A records A's event: x is covered
    p.free(y, A).unwrap(); // pending
    let l = log(&dev);
    let rec = l.iter().rev().find(|x| x.starts_with("record") && x.ends_with(&format!("on {A:#x}"))).unwrap_or_else(|| panic!("{l:?}")).clone();
    let ev = rec.split(' ').nth(1).unwrap().to_string();
    let reserved = p.stats().total_bytes;
    let b = p.malloc(2 * MIB, B).unwrap();
    assert_eq!(b, x, "B should get x (covered), not grow or take y (pending)");
    assert_eq!(p.stats().total_bytes, reserved);
    assert!(log(&dev).iter().any(|l| *l == format!("wait {B:#x} on {ev}")));
    for (ptr, s) in [(b, B), (z, A), (w, A), (big, A)] {
        p.free(ptr, s).unwrap();
    }
    p.check_invariants().unwrap();
}
