//! Growth planning: where a request that no mapped free block serves should go, and which
//! free granules can back it instead of new memory.
//!
//! A *gap* is a run of nodes with nothing allocated in it (free memory and unmapped address
//! space). Any window of a gap can hold the request once its unmapped granules are mapped.
//! The cheapest window needs the fewest granules mapped; among equals, the one whose free
//! memory is already the requester's (no cross-stream wait), then the smallest gap (best
//! fit of address space, so the range's top is used last).
//!
//! Where a window would need new memory but enough whole free granules lie scattered
//! elsewhere, a stitch (`stitch.rs`) shows them side by side instead: `stitch_homes` picks
//! them, longest idle first, and (where piece ends are on) `piece_ends` the free ends of
//! granules partly in use that the stitch may begin and end in.

use super::space::{FreeRun, Space, State};
use crate::upstream::stream_id::StreamKey;

/// A place for a request: `[start, start + len)` in one space.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Window {
    pub start: usize,
    pub len: usize,
    /// Unmapped granules the window covers, ascending.
    pub targets: Vec<usize>,
    /// Streams other than the requester's whose free memory the window covers.
    pub foreign: Vec<StreamKey>,
    /// Bytes of the gap it lies in.
    pub gap: usize,
}

/// The windows of `space` that can hold `len` bytes for `stream`, cheapest first.
pub fn windows(space: &Space, len: usize, stream: StreamKey) -> Vec<Window> {
    let mut out = Vec::new();
    // The idle nodes in address order (`Space::idle_nodes`); a gap ends where the next
    // idle node does not start at the last one's end (an allocated node lies between).
    let mut gap: Vec<super::space::Node> = Vec::new();
    let close = |gap: &mut Vec<super::space::Node>, out: &mut Vec<Window>| {
        if gap.is_empty() {
            return;
        }
        let (gs, ge) = (gap[0].addr, gap[gap.len() - 1].end());
        if ge - gs >= len {
            let mut starts: Vec<usize> = gap.iter().flat_map(|n| [n.addr, n.end().saturating_sub(len)]).collect();
            starts.extend([gs, ge - len]);
            starts.iter_mut().for_each(|w| *w = (*w).clamp(gs, ge - len));
            starts.sort_unstable();
            starts.dedup();
            for w in starts {
                out.push(window_at(space, gap, w, len, stream, ge - gs));
            }
        }
        gap.clear();
    };
    for n in space.idle_nodes() {
        if gap.last().is_some_and(|l| l.end() != n.addr) {
            close(&mut gap, &mut out);
        }
        gap.push(n);
    }
    close(&mut gap, &mut out);
    out.sort_by(|a, b| {
        (a.targets.len(), a.foreign.len(), a.gap, a.start).cmp(&(b.targets.len(), b.foreign.len(), b.gap, b.start))
    });
    out
}

fn window_at(space: &Space, gap: &[super::space::Node], w: usize, len: usize, stream: StreamKey, gap_len: usize) -> Window {
    let g = space.granule;
    let (mut targets, mut foreign) = (Vec::new(), Vec::new());
    for n in gap.iter().filter(|n| n.addr < w + len && n.end() > w) {
        match n.state {
            State::Unmapped => {
                // Unmapped nodes are whole granules, so the rounded-out overlap stays inside.
                let start = n.addr.max(w) & !(g - 1);
                let end = (n.end().min(w + len) + g - 1) & !(g - 1);
                targets.extend((start..end).step_by(g));
            }
            State::Free if n.stream != stream && !foreign.contains(&n.stream) => foreign.push(n.stream),
            _ => {}
        }
    }
    Window { start: w, len, targets, foreign, gap: gap_len }
}

/// Up to `n` free granules of `runs` (whole free granules of the large space, in address
/// order) for a new stitch, longest idle first, those needing no other stream's permission
/// before those that do (`reusable` is asked once per run it is about to use); returned in
/// address order so adjacent ones stay adjacent in the stitch.
pub fn stitch_homes(runs: &[FreeRun], n: usize, granule: usize, stream: StreamKey, reusable: &mut dyn FnMut(StreamKey, usize, usize) -> bool) -> Vec<usize> {
    let mut order: Vec<&FreeRun> = runs.iter().collect();
    order.sort_by_key(|r| (r.streams.iter().any(|&s| s != stream), r.freed_at, r.addr));
    let mut homes = Vec::with_capacity(n);
    for r in order {
        if !r.streams.iter().all(|&s| s == stream || reusable(s, r.addr, r.len)) {
            continue;
        }
        homes.extend((r.addr..r.addr + r.len).step_by(granule).take(n - homes.len()));
        if homes.len() == n {
            break;
        }
    }
    homes.sort_unstable();
    homes
}

/// A piece of a granule for a stitch's end: free memory at one end of granule `granule`,
/// whose other part holds something else, `bytes` long.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Piece {
    pub granule: usize,
    pub bytes: usize,
}

/// The largest free end of a granule (`head`: the free memory a granule ends with, which can
/// begin a stitch) and the largest free start of another (`tail`: can end one) among the
/// free blocks of `space`, skipping granules `usable` refuses (parts of chunks, loans) and
/// free memory of streams `reusable` does not allow.
/// Why: at a new peak the large range's free memory lies mostly in such pieces, between live
/// blocks (docs/arena.md, "What churn holds above its peak"); a stitch made only of whole
/// granules leaves them there and maps new memory instead.
pub fn piece_ends(space: &Space, stream: StreamKey, usable: &dyn Fn(usize) -> bool, reusable: &mut dyn FnMut(StreamKey, usize, usize) -> bool) -> (Piece, Piece) {
    let g = space.granule;
    let (mut head, mut tail) = (Piece::default(), Piece::default());
    for b in space.free_blocks() {
        let (a, e) = (b.addr, b.end());
        let (up, down) = (a.div_ceil(g) * g, e / g * g);
        let head_here = (a % g != 0 && e >= up && up - a > head.bytes && usable(up - g)).then(|| Piece { granule: up - g, bytes: up - a });
        let tail_here = (e % g != 0 && a <= down && e - down > tail.bytes && usable(down)).then(|| Piece { granule: down, bytes: e - down });
        if (head_here.is_some() || tail_here.is_some()) && b.stream != stream && !reusable(b.stream, b.addr, b.size) {
            continue;
        }
        if let Some(p) = head_here {
            head = p;
        }
        if let Some(p) = tail_here {
            tail = p;
        }
    }
    if head.bytes > 0 && head.granule == tail.granule {
        // One granule cannot end one stitch and begin it: keep the larger piece.
        if head.bytes >= tail.bytes { tail = Piece::default() } else { head = Piece::default() }
    }
    (head, tail)
}

/// Index ranges of `addrs` (ascending granule addresses) whose granules lie side by side:
/// one driver call (or one booking) per range instead of one per granule.
pub fn adjacent_runs(addrs: &[usize], granule: usize) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
    let mut i = 0;
    std::iter::from_fn(move || {
        if i >= addrs.len() {
            return None;
        }
        let start = i;
        i += 1;
        while i < addrs.len() && addrs[i] == addrs[i - 1] + granule {
            i += 1;
        }
        Some(start..i)
    })
}

/// The run of `runs` (in address order) holding granule `g`.
pub fn run_of(runs: &[FreeRun], g: usize) -> Option<&FreeRun> {
    let i = runs.partition_point(|r| r.addr + r.len <= g);
    runs.get(i).filter(|r| r.addr <= g)
}
