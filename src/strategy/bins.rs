//! The free-block index of `split`: exact best fit in near-constant time.
//!
//! Free blocks are filed in size bins, 8 per power of two (bin = octave and the next three
//! bits of the size), with a bitmap of the non-empty bins. Bins are monotonic in size, so the
//! best fit for `r` bytes -- the smallest block of at least `r`, lowest address on ties, the
//! answer an ordered set would give -- is the best entry of `r`'s own bin that fits, else the
//! smallest entry of the next non-empty bin (found with a bitmap scan). Bins hold a handful of
//! blocks each, so a lookup touches a few cache lines where a B-tree of (size, address) keys
//! walked and rebalanced nodes on every insert and remove (about a third of a churn step's
//! time, `cargo bench --bench malloc_free -- churn`). The idea is TLSF's segregated fit; unlike TLSF
//! the bin is searched for the true best fit, so fit quality is exactly that of the ordered set.

const SUB_BITS: u32 = 3;
const SUBS: usize = 1 << SUB_BITS;
const BINS: usize = usize::BITS as usize * SUBS;
const WORDS: usize = BINS / 64;

/// Bin of a block of `size` (> 0) bytes; monotonic in `size`.
#[inline]
fn bin_of(size: usize) -> usize {
    let octave = (usize::BITS - 1 - size.leading_zeros()) as usize;
    if octave < SUB_BITS as usize {
        return size; // sizes below 8 each get a bin of their own (never used: sizes are >= 512)
    }
    octave * SUBS + ((size >> (octave - SUB_BITS as usize)) & (SUBS - 1))
}

/// A filed block: (size, address, the strategy's node for it). Ordered by size, then
/// address (addresses are unique, so the node never decides).
pub type Entry = (usize, usize, u32);

/// Free blocks of one (class, stream).
pub struct FreeBins {
    bins: Vec<Vec<Entry>>,
    nonempty: [u64; WORDS],
    len: usize,
}

impl Default for FreeBins {
    fn default() -> Self {
        FreeBins { bins: (0..BINS).map(|_| Vec::new()).collect(), nonempty: [0; WORDS], len: 0 }
    }
}

impl FreeBins {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn insert(&mut self, size: usize, addr: usize, node: u32) {
        let b = bin_of(size);
        self.bins[b].push((size, addr, node));
        self.nonempty[b / 64] |= 1 << (b % 64);
        self.len += 1;
    }

    /// Remove the entry (size, addr); false if it is not there.
    pub fn remove(&mut self, size: usize, addr: usize) -> bool {
        let b = bin_of(size);
        let bin = &mut self.bins[b];
        let Some(i) = bin.iter().position(|e| (e.0, e.1) == (size, addr)) else {
            return false;
        };
        bin.swap_remove(i);
        if bin.is_empty() {
            self.nonempty[b / 64] &= !(1 << (b % 64));
        }
        self.len -= 1;
        true
    }

    pub fn contains(&self, size: usize, addr: usize) -> bool {
        self.bins[bin_of(size)].iter().any(|e| (e.0, e.1) == (size, addr))
    }

    /// The smallest entry of at least `size` bytes (lowest address among equals).
    pub fn best_fit(&self, size: usize) -> Option<Entry> {
        let b = bin_of(size);
        if let Some(e) = self.bins[b].iter().filter(|e| e.0 >= size).min() {
            return Some(*e);
        }
        let next = self.next_nonempty(b + 1)?;
        self.bins[next].iter().min().copied()
    }

    /// The smallest entry of at least `size` bytes that orders after `after` (size, then
    /// address): with `after` the previous answer, the fits one by one, best first.
    pub fn next_fit(&self, size: usize, after: (usize, usize)) -> Option<Entry> {
        let ok = |e: &&Entry| e.0 >= size && (e.0, e.1) > after;
        // Bins are monotonic in size: nothing after `after` lies below its bin.
        let mut b = bin_of(after.0.max(size));
        loop {
            if let Some(e) = self.bins[b].iter().filter(ok).min() {
                return Some(*e);
            }
            b = self.next_nonempty(b + 1)?;
        }
    }

    /// The largest entry, if any.
    pub fn largest(&self) -> Option<Entry> {
        let w = (0..WORDS).rev().find(|&w| self.nonempty[w] != 0)?;
        let b = w * 64 + 63 - self.nonempty[w].leading_zeros() as usize;
        self.bins[b].iter().max().copied()
    }

    /// First non-empty bin at or after `from`.
    fn next_nonempty(&self, from: usize) -> Option<usize> {
        let mut w = from / 64;
        if w >= WORDS {
            return None;
        }
        let mut bits = self.nonempty[w] & (!0u64 << (from % 64));
        loop {
            if bits != 0 {
                return Some(w * 64 + bits.trailing_zeros() as usize);
            }
            w += 1;
            if w == WORDS {
                return None;
            }
            bits = self.nonempty[w];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn bins_are_monotonic_in_size() {
        let mut last = 0;
        for s in (1..1 << 20).step_by(37).chain([usize::MAX / 2, usize::MAX]) {
            let b = bin_of(s);
            assert!(b >= last && b < BINS, "size {s}: bin {b} after {last}");
            last = b;
        }
    }

    /// The same answers as an ordered set of (size, addr) under random inserts, removes and
    /// queries: exact best fit, lowest address on ties, and the next fits in order.
    #[test]
    fn best_fit_matches_an_ordered_set() {
        let mut bins = FreeBins::default();
        let mut set = BTreeSet::new();
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..50_000 {
            let size = ((rnd() % (64 << 20)) as usize + 1) & !511 | 512;
            match rnd() % 4 {
                0 => {
                    let addr = (rnd() % 4096) as usize * 4096;
                    if set.insert((size, addr)) {
                        bins.insert(size, addr, (addr / 4096) as u32);
                    }
                }
                1 => {
                    let want = set.range((size, 0)..).next().copied();
                    assert_eq!(bins.best_fit(size).map(|e| (e.0, e.1)), want, "best fit for {size}");
                    if let Some((s, a)) = want {
                        set.remove(&(s, a));
                        assert!(bins.remove(s, a));
                        assert!(!bins.remove(s, a));
                    }
                }
                2 => {
                    // The fits in order, as the ordered set lists them from (size, 0).
                    let want: Vec<(usize, usize)> = set.range((size, 0)..).take(5).copied().collect();
                    let mut got = Vec::new();
                    let mut e = bins.best_fit(size).map(|e| (e.0, e.1));
                    while let Some(f) = e.filter(|_| got.len() < 5) {
                        got.push(f);
                        e = bins.next_fit(size, f).map(|e| (e.0, e.1));
                    }
                    assert_eq!(got, want, "fits for {size}");
                }
                _ => assert_eq!(bins.largest().map(|e| (e.0, e.1)), set.last().copied()),
            }
            assert_eq!(bins.len(), set.len());
        }
    }
}
