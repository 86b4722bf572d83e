//! Handing out what growth planned: a window whose granules are mapped now, and the
//! stitches (aliases of scattered granules mapped side by side) with their books.

use super::*;

impl ArenaStrategy {
    /// Hand out the window of a `Growth::Window` whose granules are all mapped now.
    pub fn carve_window(&mut self, space: usize, window: &plan::Window, stream: StreamKey) -> Block {
        self.spaces[space].carve_range(window.start, window.len, stream)
    }

    /// Book a stitch whose aliases the pool mapped at `base`; returns its id.
    pub fn add_stitch(&mut self, base: usize, homes: Vec<usize>) -> u32 {
        self.counters.stitches_made += 1;
        self.counters.granules_aliased += homes.len() as u64;
        self.stitches.add(base, homes, self.granule)
    }

    /// Hand out granules `first..first + granules` of stitch `id` to `stream` as a block of
    /// `bytes` (the request): their homes are booked as allocated, the last granule whole.
    /// What that granule holds past `bytes` serves nothing while the block lives; it counts
    /// as cached, not as bytes in use, so the pool's figures say what the request costs.
    pub fn carve_stitch(&mut self, id: u32, first: usize, granules: usize, bytes: usize, stream: StreamKey, reused: bool) -> Block {
        let g = self.granule;
        let bytes = bytes.clamp((granules.max(1) - 1) * g + 1, granules * g);
        let homes = self.stitches.get(id).homes[first..first + granules].to_vec();
        let mut borrowed = Vec::new();
        for r in plan::adjacent_runs(&homes, g) {
            let b = self.spaces[LARGE].carve_range(homes[r.start], r.len() * g, stream);
            borrowed.push(b.handle);
        }
        self.stitches.touch(id);
        self.stitch_tail_bytes += granules * g - bytes;
        let st = self.stitches.get_mut(id);
        st.borrowed = borrowed;
        st.in_use = true;
        st.first_in_use = first;
        st.granules_in_use = granules;
        st.bytes_in_use = bytes;
        st.tail_in_use = granules * g - bytes;
        st.pieced = false;
        if reused {
            self.counters.stitch_reuses += 1;
        }
        Block { addr: st.base + first * g, size: bytes, segment: self.stitches.base, stream, handle: id }
    }

    /// Hand out new stitch `id` whole as a block of `bytes` that begins `head` bytes before
    /// the end of its first granule (0: at its start) and, where `tail`, ends in its last:
    /// those two granules hold other blocks too, so only the parts the block takes are
    /// booked (`plan::piece_ends`).
    pub fn carve_pieced_stitch(&mut self, id: u32, head: usize, tail: bool, bytes: usize, stream: StreamKey) -> Block {
        let g = self.granule;
        let homes = self.stitches.get(id).homes.clone();
        let (lo, hi) = (usize::from(head > 0), homes.len() - usize::from(tail));
        let mut borrowed = Vec::new();
        if head > 0 {
            borrowed.push(self.spaces[LARGE].carve_range(homes[0] + g - head, head, stream).handle);
        }
        let whole = &homes[lo..hi];
        for r in plan::adjacent_runs(whole, g) {
            borrowed.push(self.spaces[LARGE].carve_range(whole[r.start], r.len() * g, stream).handle);
        }
        let in_whole = bytes - head;
        let unused = if tail {
            borrowed.push(self.spaces[LARGE].carve_range(homes[hi], in_whole - whole.len() * g, stream).handle);
            0
        } else {
            whole.len() * g - in_whole
        };
        self.stitches.touch(id);
        self.counters.stitch_pieces += u64::from(head > 0) + u64::from(tail);
        self.stitch_tail_bytes += unused;
        let st = self.stitches.get_mut(id);
        st.borrowed = borrowed;
        st.in_use = true;
        st.first_in_use = 0;
        st.granules_in_use = homes.len();
        st.bytes_in_use = bytes;
        st.tail_in_use = unused;
        st.pieced = true;
        Block { addr: st.base + if head > 0 { g - head } else { 0 }, size: bytes, segment: self.stitches.base, stream, handle: id }
    }

    /// `(base, len, granules already unaliased)` of stitch `id`, for the pool to remove its
    /// aliases before `drop_stitch`.
    pub fn stitch_range(&self, id: u32) -> (usize, usize, usize) {
        let st = self.stitches.get(id);
        (st.base, st.len, st.unaliased)
    }

    /// The stream stitch `id`'s block was last freed on.
    pub fn stitch_last_stream(&self, id: u32) -> Option<StreamKey> {
        self.stitches.get(id).last_stream
    }

    /// Removing stitch `id`'s aliases failed at granule `at`: never hand it out again.
    pub fn stitch_broken(&mut self, id: u32, at: usize) {
        let st = self.stitches.get_mut(id);
        st.broken = true;
        st.unaliased = at;
    }

    /// Forget stitch `id` (free; the pool removed its aliases).
    pub fn drop_stitch(&mut self, id: u32) {
        self.stitches.remove(id);
        self.counters.stitches_dropped += 1;
    }

    /// Free stitches showing granules of `[addr, addr + len)`.
    pub fn stitches_over(&self, addr: usize, len: usize) -> Vec<u32> {
        self.stitches.over(addr, len, self.granule).into_iter().filter(|&id| !self.stitches.get(id).in_use).collect()
    }

    /// Every stitch not handed out (teardown).
    pub fn free_stitches(&self) -> Vec<u32> {
        self.stitches.iter().filter(|(_, s)| !s.in_use).map(|(id, _)| id).collect()
    }
}
