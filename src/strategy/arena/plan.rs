//! Growth planning: where a request that no mapped free block serves should go, and which
//! free granules can back it instead of new memory.
//!
//! A *gap* is a run of nodes with nothing allocated in it (free memory and unmapped address
//! space). Any window of a gap can hold the request once its unmapped granules are mapped.
//! The cheapest window needs the fewest granules mapped; among equals, the one whose free
//! memory is already the requester's (no cross-stream wait), then the smallest gap (best
//! fit of address space, so the range's top is used last).
//!
//! The granules to map come first from free memory elsewhere: whole granules inside free
//! nodes, longest idle first, moved to the window by mapping their physical memory there
//! (stitching). Only what they cannot cover is new memory. So the arena holds no more
//! memory than its live blocks need, rounded to granules, however the free space is
//! scattered; and because the window stays mapped after its block is freed, a step that
//! repeats finds it free the next time and makes no driver call.

use super::space::{FreeRun, Space, State};
use crate::stream::StreamKey;

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

/// A granule of free memory that can be moved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Donor {
    pub space: usize,
    pub addr: usize,
    /// Streams whose work must finish before it moves.
    pub streams: Vec<StreamKey>,
}

/// The windows of `space` that can hold `len` bytes for `stream`, cheapest first.
pub fn windows(space: &Space, len: usize, stream: StreamKey) -> Vec<Window> {
    let nodes: Vec<_> = space.walk().map(|(_, n)| *n).collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < nodes.len() {
        if nodes[i].state == State::Allocated {
            i += 1;
            continue;
        }
        let mut j = i;
        while j < nodes.len() && nodes[j].state != State::Allocated {
            j += 1;
        }
        let gap = &nodes[i..j];
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
        i = j;
    }
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

/// Up to `want` free granules of `spaces` outside `[avoid_start, avoid_end)` of space
/// `avoid_space`, longest idle first, each free node giving its highest granules first
/// (what stays free of it stays in one piece).
pub fn donors(spaces: &[&Space], want: usize, avoid_space: usize, avoid_start: usize, avoid_end: usize) -> Vec<Donor> {
    if want == 0 {
        return Vec::new();
    }
    let mut runs: Vec<(usize, FreeRun)> = Vec::new();
    for (si, sp) in spaces.iter().enumerate() {
        runs.extend(sp.free_granule_runs().into_iter().map(|r| (si, r)));
    }
    runs.sort_unstable_by_key(|(si, r)| (r.freed_at, *si, r.addr));
    let mut out = Vec::new();
    for (si, run) in runs {
        let g = spaces[si].granule;
        for a in (run.addr..run.addr + run.len).step_by(g).rev() {
            if si == avoid_space && a < avoid_end && a + g > avoid_start {
                continue;
            }
            out.push(Donor { space: si, addr: a, streams: run.streams.clone() });
            if out.len() == want {
                return out;
            }
        }
    }
    out
}
