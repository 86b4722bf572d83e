//! A slab of bookkeeping nodes addressed by slot (`u32`), with a free list of vacant slots:
//! what `split` and the arena keep their blocks in, so neighbours link by slot and a free
//! finds its node through `Block::handle` without an address lookup.

pub type Slot = u32;
/// No neighbour.
pub const NIL: Slot = u32::MAX;

pub struct Slab<N> {
    pub nodes: Vec<N>,
    pub vacant: Vec<Slot>,
}

impl<N> Default for Slab<N> {
    fn default() -> Self {
        Slab { nodes: Vec::new(), vacant: Vec::new() }
    }
}

impl<N> Slab<N> {
    /// Store `node` in a vacant slot (or a new one); returns its slot.
    pub fn alloc(&mut self, node: N) -> Slot {
        match self.vacant.pop() {
            Some(s) => {
                self.nodes[s as usize] = node;
                s
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as Slot
            }
        }
    }

    /// Slot `s` holds no node any more (the caller marked the node vacant).
    pub fn release(&mut self, s: Slot) {
        self.vacant.push(s);
    }

    /// Slots in use.
    pub fn occupied(&self) -> usize {
        self.nodes.len() - self.vacant.len()
    }
}
