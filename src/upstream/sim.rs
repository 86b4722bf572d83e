//! A simulated device for `gpupool-replay`: hands out address ranges of a device of
//! `capacity` bytes without touching memory, so a user's trace can be replayed against an
//! 80 GiB "GPU" on a laptop.

use super::{AllocError, Upstream};
use crate::error::Result;
use crate::stream::StreamHandle;
use std::collections::BTreeSet;

/// Page size of the simulated device: the GPU's mapping granularity.
pub const SIM_PAGE: usize = 2 << 20;

pub struct SimUpstream {
    capacity: usize,
    allocated: usize,
    next: usize,
    /// Decommitted pages (they do not count as allocated).
    decommitted: BTreeSet<usize>,
    /// Whether pages can be decommitted (`vmm`-like) or only whole segments (`device`-like).
    paged: bool,
}

impl SimUpstream {
    /// A `device`-like simulated GPU: only whole segments go back.
    pub fn new(capacity: usize) -> Self {
        Self::with_pages(capacity, false)
    }

    /// `paged`: pages inside segments can be given back, as with the `vmm` upstream.
    pub fn with_pages(capacity: usize, paged: bool) -> Self {
        // Start high and leave gaps so distinct segments are never adjacent by accident.
        SimUpstream { capacity, allocated: 0, next: 1 << 44, decommitted: BTreeSet::new(), paged }
    }
}

impl Upstream for SimUpstream {
    fn name(&self) -> &'static str {
        "simulated"
    }
    fn allocate(&mut self, size: usize, _stream: StreamHandle) -> std::result::Result<usize, AllocError> {
        if size == 0 || size > self.capacity - self.allocated {
            return Err(AllocError::OutOfMemory);
        }
        let addr = self.next;
        self.next += size.div_ceil(SIM_PAGE) * SIM_PAGE + SIM_PAGE;
        self.allocated += size;
        Ok(addr)
    }
    fn deallocate(&mut self, addr: usize, size: usize, _stream: StreamHandle) -> Result<()> {
        let holes: Vec<usize> = self.decommitted.range(addr..addr + size).copied().collect();
        for p in &holes {
            self.decommitted.remove(p);
        }
        self.allocated -= size - holes.len() * SIM_PAGE;
        Ok(())
    }
    fn page_size(&self) -> usize {
        if self.paged {
            SIM_PAGE
        } else {
            0
        }
    }
    fn commit(&mut self, addr: usize, len: usize) -> std::result::Result<(), AllocError> {
        if len > self.capacity - self.allocated {
            return Err(AllocError::OutOfMemory);
        }
        for p in (addr..addr + len).step_by(SIM_PAGE) {
            assert!(self.decommitted.remove(&p), "commit of a committed page {p:#x}");
        }
        self.allocated += len;
        Ok(())
    }
    fn decommit(&mut self, addr: usize, len: usize) -> Result<()> {
        for p in (addr..addr + len).step_by(SIM_PAGE) {
            assert!(self.decommitted.insert(p), "decommit of a decommitted page {p:#x}");
        }
        self.allocated -= len;
        Ok(())
    }
    fn mem_info(&mut self) -> Result<(usize, usize)> {
        Ok((self.capacity - self.allocated, self.capacity))
    }
}
