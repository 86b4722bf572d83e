//! Unit tests of the stream placements (`super`): round robin, moves off a shared shard,
//! a full table, racing threads.

use super::*;
use std::sync::Arc;

#[test]
fn streams_are_dealt_round_robin_and_keep_their_shard() {
    let t = StreamShards::new();
    let handles: Vec<usize> = (1..=32).map(|i| 0x7f00_0000_0000 + i * 0x40).collect();
    let first: Vec<usize> = handles.iter().map(|&h| t.shard_of(h, 16)).collect();
    for (i, &s) in first.iter().enumerate() {
        assert_eq!(s, 1 + i % 16, "stream {i} placed out of turn");
    }
    for (&h, &s) in handles.iter().zip(&first) {
        assert_eq!(t.shard_of(h, 16), s);
        assert_eq!(t.placed(h, 16), Some(s));
    }
    assert_eq!(t.placed(0xdead_0000, 16), None);
    // A device remade with fewer shards keeps each stream's turn, modulo the new count.
    assert_eq!(t.shard_of(handles[5], 4), 1 + 5 % 4);
}

/// Shard `k`'s lock held while `allocating` runs, as the registry holds it.
fn alloc_on(t: &StreamShards, locks: &[std::sync::Mutex<()>], h: usize, n: usize) -> usize {
    let k = t.shard_of(h, n);
    let _g = locks[k].lock().unwrap();
    t.allocating(h, k, n);
    k
}

fn locks() -> Vec<std::sync::Mutex<()>> {
    (0..SHARDS).map(|_| std::sync::Mutex::new(())).collect()
}

/// `count` allocations taking turns between `streams` (all on one shard): each one
/// after the shard's first is an alternation.
fn take_turns(t: &StreamShards, l: &[std::sync::Mutex<()>], streams: [usize; 2], count: u32, n: usize, turn: &mut usize) {
    for _ in 0..count {
        alloc_on(t, l, streams[*turn % 2], n);
        *turn += 1;
    }
}

#[test]
fn a_stream_sharing_its_shard_moves_to_the_idle_one() {
    // One thread drives both streams, as a thread serving two streams would.
    let (t, l, n) = (StreamShards::new(), locks(), 4);
    let (a, b, c, gone, x) = (0x1000, 0x2000, 0x3000, 0x4000, 0x5000);
    let placed: Vec<usize> = [a, b, c, gone, x].iter().map(|&h| t.shard_of(h, n)).collect();
    assert_eq!(placed, [1, 2, 3, 4, 1], "x is dealt a's shard; the stream on 4 is gone");
    let mut turn = 0;
    take_turns(&t, &l, [a, x], 1 + MOVE_AFTER / 2, n, &mut turn); // the halfway counts
    alloc_on(&t, &l, b, n); // shards 2 and 3 work in the window; 4 does not
    alloc_on(&t, &l, c, n);
    std::thread::sleep(IDLE_WINDOW);
    take_turns(&t, &l, [a, x], MOVE_AFTER / 2 - 1, n, &mut turn);
    assert_eq!((t.shard_of(a, n), t.shard_of(x, n)), (1, 1), "fewer alternations move nothing");
    let epoch = super::super::which_shard::placement_epoch();
    take_turns(&t, &l, [a, x], 1, n, &mut turn);
    let mut now = [t.shard_of(a, n), t.shard_of(x, n)];
    now.sort();
    assert_eq!(now, [1, 4], "one of the two moved, to the one idle shard");
    // Threads that remembered the old placement ask again (`thread_cache::shard_for`).
    assert_ne!(super::super::which_shard::placement_epoch(), epoch, "a move changes the placement epoch");
    assert_eq!((t.shard_of(b, n), t.shard_of(c, n)), (2, 3));
    // Apart, they no longer alternate: nothing moves again.
    for _ in 0..4 * MOVE_AFTER {
        alloc_on(&t, &l, a, n);
        alloc_on(&t, &l, x, n);
    }
    let mut later = [t.shard_of(a, n), t.shard_of(x, n)];
    later.sort();
    assert_eq!(later, [1, 4]);
}

#[test]
fn a_stream_stays_when_every_other_shard_is_busy() {
    let (t, l, n) = (StreamShards::new(), locks(), 3);
    let (a, b, c, x) = (0x1000, 0x2000, 0x3000, 0x4000);
    let placed: Vec<usize> = [a, b, c, x].iter().map(|&h| t.shard_of(h, n)).collect();
    assert_eq!(placed, [1, 2, 3, 1]);
    let mut turn = 0;
    take_turns(&t, &l, [a, x], 1, n, &mut turn); // the shard's first note: no alternation
    for round in 0..3 {
        take_turns(&t, &l, [a, x], MOVE_AFTER / 2, n, &mut turn);
        alloc_on(&t, &l, b, n);
        alloc_on(&t, &l, c, n);
        std::thread::sleep(IDLE_WINDOW);
        take_turns(&t, &l, [a, x], MOVE_AFTER / 2, n, &mut turn);
        assert_eq!((t.shard_of(a, n), t.shard_of(x, n)), (1, 1), "round {round}: moving would make another pair share");
    }
}

#[test]
fn a_second_stream_judging_at_once_does_not_follow_the_first() {
    // a and x share shard 1, shard 3's stream is gone, b works on shard 2. Both threads
    // took their halfway counts, then judge one after the other: the first moves to 3
    // and claims it, the second must find 3 busy and stay (else they share again).
    let (t, l, n) = (Arc::new(StreamShards::new()), Arc::new(locks()), 3);
    let (a, b, gone, x) = (0x1000, 0x2000, 0x3000, 0x4000);
    let placed: Vec<usize> = [a, b, gone, x].iter().map(|&h| t.shard_of(h, n)).collect();
    assert_eq!(placed, [1, 2, 3, 1]);
    alloc_on(&t, &l, a, n);
    let ready = Arc::new(std::sync::Barrier::new(2));
    let second = {
        let (t, l, ready) = (t.clone(), l.clone(), ready.clone());
        std::thread::spawn(move || {
            t.remember_counts(1); // x's thread at the halfway alternation
            ready.wait(); // counts taken
            ready.wait(); // a has moved
            let _g = l[1].lock().unwrap();
            t.activity[1].alternations.store(MOVE_AFTER - 1, Ordering::Relaxed);
            t.activity[1].last_stream.store(a, Ordering::Relaxed);
            t.allocating(x, 1, n); // the 32nd alternation: x judges
        })
    };
    t.remember_counts(1); // a's thread at the halfway alternation
    ready.wait();
    alloc_on(&t, &l, b, n); // shard 2 works in the window
    std::thread::sleep(IDLE_WINDOW);
    {
        let _g = l[1].lock().unwrap();
        t.activity[1].alternations.store(MOVE_AFTER - 1, Ordering::Relaxed);
        t.activity[1].last_stream.store(x, Ordering::Relaxed);
        t.allocating(a, 1, n); // a judges first
    }
    assert_eq!(t.shard_of(a, n), 3, "a moved to the idle shard");
    ready.wait();
    second.join().unwrap();
    assert_eq!(t.shard_of(x, n), 1, "x followed a onto the shard a claimed");
    assert_eq!(t.shard_of(b, n), 2);
}

#[test]
fn a_stream_on_a_dead_streams_shard_does_not_move() {
    // A destroyed stream's note stays on its shard: the next stream there counts one
    // alternation, and never more.
    let (t, l, n) = (StreamShards::new(), locks(), 2);
    let (dead, h) = (0x1000, 0x2000 + 0x40);
    alloc_on(&t, &l, dead, n);
    t.shard_of(0x5000, n); // the next turn: shard 2
    assert_eq!(t.shard_of(h, n), 1, "h is dealt the dead stream's shard");
    for _ in 0..10 * MOVE_AFTER {
        assert_eq!(alloc_on(&t, &l, h, n), 1);
    }
    std::thread::sleep(IDLE_WINDOW);
    for _ in 0..10 * MOVE_AFTER {
        assert_eq!(alloc_on(&t, &l, h, n), 1);
    }
}

#[test]
fn two_working_streams_on_one_shard_end_on_shards_of_their_own() {
    // As in threads_bench's 16-thread rows: a recycled handle keeps an earlier stream's
    // shard, so two working streams share shard 1 while shard 3 has no stream at all.
    let (t, l, n) = (Arc::new(StreamShards::new()), Arc::new(locks()), 3);
    let (a, busy, b) = (0x7000, 0x8000, 0x9000);
    assert_eq!((t.shard_of(a, n), t.shard_of(busy, n)), (1, 2));
    t.shard_of(0xa000, n); // shard 3's stream, destroyed before the others start
    assert_eq!(t.shard_of(b, n), 1, "b shares a's shard");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let workers: Vec<_> = [a, busy, b]
        .into_iter()
        .map(|h| {
            let (t, l, stop) = (t.clone(), l.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    alloc_on(&t, &l, h, n);
                    std::thread::yield_now(); // let the other stream in between
                }
            })
        })
        .collect();
    let apart = || {
        let (sa, sb, sc) = (t.shard_of(a, n), t.shard_of(b, n), t.shard_of(busy, n));
        sa != sb && sb != sc && sa != sc
    };
    let t0 = Instant::now();
    while !apart() && t0.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(1));
    }
    // Once apart no stream meets another, so nothing moves again. (A mover may take the
    // busy stream's shard when that thread was descheduled for the whole window, as on
    // a loaded machine; the busy stream then moves in turn.)
    let placed = [a, b, busy].map(|h| t.shard_of(h, n));
    std::thread::sleep(Duration::from_millis(50));
    stop.store(true, Ordering::Relaxed);
    workers.into_iter().for_each(|w| w.join().unwrap());
    assert!(apart(), "still sharing after {:?}", t0.elapsed());
    assert_eq!([a, b, busy].map(|h| t.shard_of(h, n)), placed, "a stream moved after all were apart");
}

#[test]
fn a_full_table_still_places_every_stream_in_range() {
    let t = StreamShards::new();
    for h in 1..=(3 * ENTRIES) {
        let s = t.shard_of(h * 256, 5);
        assert!((1..=5).contains(&s));
        assert_eq!(t.shard_of(h * 256, 5), s, "handle {h} moved");
    }
}

#[test]
fn threads_racing_to_place_one_stream_agree() {
    let t = Arc::new(StreamShards::new());
    let got: Vec<usize> = (0..8)
        .map(|_| {
            let t = t.clone();
            std::thread::spawn(move || t.shard_of(0x5000, 4))
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|j| j.join().unwrap())
        .collect();
    assert!(got.iter().all(|&s| s == got[0]), "{got:?}");
}
