//! How the arena serves a request no free block serves (`ArenaStrategy::plan`, the order
//! the module docs give), and the scraps of the large range that small requests may take
//! first (`take_spilled`).

use super::*;

impl ArenaStrategy {
    /// How to serve `rounded` bytes for `stream` when no free block does (module docs give
    /// the order). `reusable` is asked before another stream's free memory is used.
    /// `None`: no address space left that could hold it.
    /// `rules`: what this step of the growth allows (`PlanRules`).
    pub fn plan(&self, rounded: usize, stream: StreamKey, rules: PlanRules, reusable: &mut dyn FnMut(StreamKey, usize, usize) -> bool) -> Option<Growth> {
        let si = Self::class(rounded);
        let windows = plan::windows(&self.spaces[si], rounded, stream);
        // Other streams are asked (which may make this one wait on them) only for the
        // window actually chosen, the cheapest they allow.
        let chosen = |reusable: &mut dyn FnMut(StreamKey, usize, usize) -> bool| {
            windows.iter().find(|w| w.foreign.iter().all(|&s| reusable(s, w.start, w.len))).cloned().map(|window| Growth::Window { space: si, window })
        };
        if si == SMALL || windows.first().is_some_and(|w| w.targets.is_empty()) {
            return chosen(reusable);
        }
        let g = self.granule;
        let whole = round_up(rounded, g)?;
        let runs = self.home_runs(LARGE);
        // A cached stitch with `k` granules in a row whose homes are all free (and whose
        // streams allow): no driver call.
        let k = whole / g;
        for id in self.stitches.candidates(rounded) {
            let st = self.stitches.get(id);
            let homes: Vec<Option<&FreeRun>> = st.homes.iter().map(|&h| plan::run_of(&runs, h)).collect();
            let mut row = 0;
            for (i, h) in homes.iter().enumerate() {
                row = if h.is_some() { row + 1 } else { 0 };
                if row == k {
                    let first = i + 1 - k;
                    let allowed = (first..=i).all(|j| {
                        homes[j].is_some_and(|r| r.streams.iter().all(|&s| s == stream || reusable(s, st.homes[j], g)))
                    });
                    if allowed {
                        return Some(Growth::Reuse { id, first, granules: k });
                    }
                    row = 0;
                }
            }
        }
        // Scattered free granules, topped up with new ones: a stitch, where it needs less
        // new memory than the window.
        let n = whole / g;
        // Chunks are stitched whole: only runs of whole allocations count.
        let runs = self.chunks.whole_runs(runs);
        let free: usize = runs.iter().map(|r| r.len / g).sum();
        let window_new = windows.first().map_or(usize::MAX, |w| w.targets.len());
        // With piece ends on, where the free granules do not suffice, the stitch may begin
        // and end in pieces of granules partly in use, whichever of them needs the fewest
        // new granules (fewer pieces on a tie: each is one more alias). Not while the stitch
        // cache is full: a stitch that only its pieces make worth making would evict a cached
        // stitch, which may be free whole again where one that ends in pieces seldom is, so
        // the window serves instead. A stitch worth making without pieces still evicts, and
        // the plan after the eviction may use them; and where the window is refused (the
        // limit, a full device) or there is none, the growth plans again with pieces.
        let (mut n, mut head, mut tail) = (n, plan::Piece::default(), plan::Piece::default());
        if self.piece_ends && n > free && (rules.pieces_when_full || self.stitches.count() < stitch::MAX_STITCHES) {
            // Not a whole free granule (a stitch takes those whole), a chunk's or a loan's.
            let usable = |at: usize| plan::run_of(&runs, at).is_none() && self.chunks.of(at).is_none() && !self.loans.contains_key(&at);
            let (h, t) = plan::piece_ends(&self.spaces[LARGE], stream, &usable, reusable);
            let none = plan::Piece::default();
            for (ph, pt) in [(h, none), (none, t), (h, t)] {
                if ph.bytes + pt.bytes == 0 {
                    continue;
                }
                let m = rounded.saturating_sub(ph.bytes + pt.bytes).div_ceil(g);
                if pt.bytes > 0 && ph.bytes + m * g >= rounded {
                    continue; // the tail piece would hold nothing
                }
                if m.saturating_sub(free) < n.saturating_sub(free) {
                    (n, head, tail) = (m, ph, pt);
                }
            }
        }
        let pieces = usize::from(head.bytes > 0) + usize::from(tail.bytes > 0);
        if (rules.small_stitches || whole > CONTENDED_STITCH_FROM * g) && n.saturating_sub(free) < window_new {
            let full = self.stitches.count() >= stitch::MAX_STITCHES;
            // Evict only where the stitch could then fit (a request larger than the range
            // would otherwise empty the cache one eviction at a time, and still fail).
            let span = (n + pieces) * g;
            if rules.may_evict && self.stitches.could_hold(span) && (full || self.stitches.find_va(span).is_none()) {
                if let Some(id) = self.stitches.least_recently_used() {
                    return Some(Growth::Evict { id });
                }
            }
            // Chunks go in whole, so a stitch may show more than `n` granules.
            let fits = |s: &Self, granules: usize| s.stitches.find_va(granules * g).filter(|_| !full);
            let mut homes = match fits(self, n + pieces) {
                Some(_) => self.chunks.extend(plan::stitch_homes(&runs, n, g, stream, reusable)),
                None => Vec::new(),
            };
            let new = n.saturating_sub(homes.len());
            // Chunks can make the stitch longer than the request: evict for its true length.
            if rules.may_evict && !homes.is_empty() && self.stitches.could_hold((homes.len() + new + pieces) * g) && fits(self, homes.len() + new + pieces).is_none() {
                if let Some(id) = self.stitches.least_recently_used() {
                    return Some(Growth::Evict { id });
                }
            }
            if let Some(base) = fits(self, n + pieces).and_then(|_| fits(self, homes.len() + new + pieces)) {
                if new < window_new {
                    let fresh: Vec<usize> = match new {
                        0 => Vec::new(),
                        _ => match self.spaces[LARGE].unmapped_run(new * g) {
                            Some(at) => (at..at + new * g).step_by(g).collect(),
                            None => return chosen(reusable),
                        },
                    };
                    homes.extend(&fresh);
                    homes.sort_unstable();
                    if pieces == 0 {
                        return Some(Growth::Stitch { base, homes, fresh, take: n, head: 0, tail: false });
                    }
                    // Chunks can show more whole granules than asked for; the block then ends
                    // in them, and a tail piece would hold nothing.
                    let ends_in_piece = tail.bytes > 0 && homes.len() == n;
                    if head.bytes > 0 {
                        homes.insert(0, head.granule);
                    }
                    if ends_in_piece {
                        homes.push(tail.granule);
                    }
                    let take = homes.len();
                    return Some(Growth::Stitch { base, homes, fresh, take, head: head.bytes, tail: ends_in_piece });
                }
            }
        }
        chosen(reusable)
    }

    /// A small request that the small range could serve only with new memory takes a
    /// scrap of the large range instead (`Space::take_scrap`: free memory in a granule that
    /// a live large block holds too), if one fits (no driver call).
    /// Why: the two ranges peak at different times, and at the small range's peak the large
    /// range's free memory sits largely in such scraps, which neither a loan (whole
    /// granules only) nor a release can use while their large block lives. The crumb pins
    /// no granule that was not pinned already.
    pub fn take_spilled(&mut self, rounded: usize, stream: StreamKey, reusable: &mut dyn FnMut(StreamKey, usize, usize) -> bool) -> Option<Block> {
        if Self::class(rounded) != SMALL {
            return None;
        }
        self.spaces[LARGE].take_scrap(rounded, stream, reusable)
    }

    /// `take_spilled` before any planning, where planning could offer nothing better: all of
    /// the small range's free memory is the requester's own, so its free nodes are merged,
    /// none needs another stream's permission, and a window without new memory would be one
    /// free node, which `take` found too small. (Another stream's free memory may hold a
    /// window that is reusable where that stream's best fit, all `take` asks about, is not.)
    /// Why: small requests the small range cannot serve from a free block are common in a
    /// churn of mixed sizes, and planning lists every window of the range first, only for
    /// the scrap to serve.
    pub fn take_spilled_unplanned(&mut self, rounded: usize, stream: StreamKey, reusable: &mut dyn FnMut(StreamKey, usize, usize) -> bool) -> Option<Block> {
        if Self::class(rounded) != SMALL || !self.spaces[SMALL].free_only_on(stream) {
            return None;
        }
        self.take_spilled(rounded, stream, reusable)
    }
}
