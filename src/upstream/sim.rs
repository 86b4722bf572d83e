//! A simulated device for `gpupool-replay`: hands out address ranges of a device of
//! `capacity` bytes without touching memory, so a user's trace can be replayed against an
//! 80 GiB "GPU" on a laptop.

use super::{AliasFail, AllocError, DriverCalls, Events, Ipc, Memory, UnmapFail, VirtualMemory};
use crate::error::{Error, Result};
use crate::upstream::stream_id::StreamHandle;
use std::collections::BTreeSet;

/// Page size of the simulated device: the GPU's mapping granularity.
pub const SIM_PAGE: usize = 2 << 20;

/// Where the simulated device's addresses begin (high, so they look like a GPU's).
const SIM_BASE: usize = 1 << 44;

pub struct SimUpstream {
    capacity: usize,
    allocated: usize,
    next: usize,
    /// Decommitted pages (they do not count as allocated).
    decommitted: BTreeSet<usize>,
    /// Whether pages can be decommitted (`vmm`-like) or only whole segments (`device`-like).
    paged: bool,
    /// Granules mapped through the virtual memory API (the arena), and aliases of them.
    mapped: BTreeSet<usize>,
    aliases: BTreeSet<usize>,
    calls: DriverCalls,
    /// Chunks (one allocation of several granules) and alias mappings of them: start ->
    /// bytes, for the driver-call counts (a chunk is one call where a granule is one).
    chunks: std::collections::BTreeMap<usize, usize>,
    alias_chunks: std::collections::BTreeMap<usize, usize>,
    /// The unit the arena maps in: `SIM_PAGE`, or a power-of-two multiple of it asked for
    /// (`vmm_set_granule`, a tag's pool), so a replay shows what a tag's granule holds.
    granule: usize,
}

impl SimUpstream {
    /// A `device`-like simulated GPU: only whole segments go back.
    pub fn new(capacity: usize) -> Self {
        Self::with_pages(capacity, false)
    }

    /// `paged`: pages inside segments can be given back, as with the `vmm` upstream.
    pub fn with_pages(capacity: usize, paged: bool) -> Self {
        // Start high and leave gaps so distinct segments are never adjacent by accident.
        SimUpstream {
            capacity,
            allocated: 0,
            next: SIM_BASE,
            decommitted: BTreeSet::new(),
            paged,
            mapped: BTreeSet::new(),
            aliases: BTreeSet::new(),
            calls: DriverCalls::default(),
            chunks: Default::default(),
            alias_chunks: Default::default(),
            granule: SIM_PAGE,
        }
    }
}

impl Memory for SimUpstream {
    fn name(&self) -> &'static str {
        "simulated"
    }
    fn allocate(&mut self, size: usize, _stream: StreamHandle) -> std::result::Result<usize, AllocError> {
        self.calls.malloc += 1;
        if size == 0 || size > self.capacity - self.allocated {
            return Err(AllocError::OutOfMemory);
        }
        let addr = self.next;
        self.next += size.div_ceil(SIM_PAGE) * SIM_PAGE + SIM_PAGE;
        self.allocated += size;
        Ok(addr)
    }
    fn deallocate(&mut self, addr: usize, size: usize, _stream: StreamHandle) -> Result<()> {
        self.calls.free += 1;
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
    fn decommit(&mut self, addr: usize, len: usize) -> std::result::Result<(), UnmapFail> {
        for p in (addr..addr + len).step_by(SIM_PAGE) {
            assert!(self.decommitted.insert(p), "decommit of a decommitted page {p:#x}");
        }
        self.allocated -= len;
        Ok(())
    }
    fn driver_calls(&self) -> DriverCalls {
        self.calls
    }
    fn mem_info(&mut self) -> Result<(usize, usize)> {
        Ok((self.capacity - self.allocated, self.capacity))
    }
}

impl VirtualMemory for SimUpstream {
    fn vmm_granule(&mut self) -> usize {
        self.granule
    }
    fn vmm_set_granule(&mut self, bytes: usize) -> usize {
        // As the real upstreams: only before anything is reserved or mapped.
        if bytes > SIM_PAGE && bytes.is_power_of_two() && self.next == SIM_BASE && self.allocated == 0 {
            self.granule = bytes;
        }
        self.granule
    }
    fn vmm_device_granule(&self) -> usize {
        SIM_PAGE
    }
    fn vmm_reserve(&mut self, len: usize) -> Result<usize> {
        self.calls.address_reserve += 1;
        let base = self.next.next_multiple_of(self.granule);
        self.next = base + len.div_ceil(self.granule) * self.granule + self.granule;
        Ok(base)
    }
    fn vmm_unreserve(&mut self, base: usize, len: usize) -> Result<()> {
        self.calls.address_free += 1;
        if self.mapped.range(base..base + len).next().is_some() {
            return Err(Error::Internal("simulated vmm: reservation still has mapped granules".into()));
        }
        Ok(())
    }
    fn vmm_map_chunk(&mut self, addr: usize, len: usize) -> std::result::Result<(), AllocError> {
        let before = self.calls;
        if let Err(e) = self.vmm_map_new(addr, len) {
            // One refused create, not one per granule.
            self.calls = before;
            self.calls.mem_create += 1;
            return Err(e);
        }
        if len > self.granule {
            self.chunks.insert(addr, len);
        }
        (self.calls.mem_create, self.calls.mem_map) = (before.mem_create + 1, before.mem_map + 1);
        Ok(())
    }
    fn vmm_map_new(&mut self, addr: usize, len: usize) -> std::result::Result<(), AllocError> {
        self.calls.mem_create += (len / self.granule) as u64;
        if len > self.capacity - self.allocated {
            return Err(AllocError::OutOfMemory);
        }
        for g in (addr..addr + len).step_by(self.granule) {
            assert!(self.mapped.insert(g), "simulated vmm: granule {g:#x} mapped twice");
        }
        self.calls.mem_map += (len / self.granule) as u64;
        self.calls.set_access += 1;
        self.allocated += len;
        Ok(())
    }
    /// Never fails: the replay's device has no driver to refuse.
    fn vmm_unmap(&mut self, addr: usize, len: usize) -> std::result::Result<(), UnmapFail> {
        for g in (addr..addr + len).step_by(self.granule) {
            assert!(self.mapped.remove(&g), "simulated vmm: unmap of unmapped granule {g:#x}");
        }
        let n = (len / self.granule - sim_in_chunks(&mut self.chunks, addr, len, self.granule)) as u64;
        self.calls.mem_unmap += n;
        self.calls.mem_release += n;
        self.allocated -= len;
        Ok(())
    }
    fn vmm_alias(&mut self, homes: &[usize], to: usize) -> std::result::Result<(), AliasFail> {
        for (i, &home) in homes.iter().enumerate() {
            let at = to + i * self.granule;
            if !self.mapped.contains(&home) || !self.aliases.insert(at) {
                let error = Error::Internal(format!("simulated vmm: bad alias {home:#x} -> {at:#x}"));
                return Err(AliasFail { made: i, error });
            }
            if self.chunks.get(&home).is_some_and(|&l| i + l / self.granule <= homes.len()) {
                let l = self.chunks[&home];
                self.alias_chunks.insert(at, l);
                self.calls.mem_map += 1;
            } else if !self.alias_chunks.range(..at).next_back().is_some_and(|(&b, &l)| at < b + l) {
                self.calls.mem_map += 1;
            }
        }
        self.calls.set_access += 1;
        Ok(())
    }
    fn vmm_unalias(&mut self, addr: usize, len: usize) -> Result<()> {
        for g in (addr..addr + len).step_by(self.granule) {
            if !self.aliases.remove(&g) {
                return Err(Error::Internal(format!("simulated vmm: unalias of {g:#x}, which is no alias")));
            }
        }
        self.calls.mem_unmap += (len / self.granule - sim_in_chunks(&mut self.alias_chunks, addr, len, self.granule)) as u64;
        Ok(())
    }
}

impl Ipc for SimUpstream {}

impl Events for SimUpstream {}

/// Granules of `[addr, addr + len)` beyond the first of each chunk of `chunks` starting
/// there (a chunk is one call), forgetting those chunks.
fn sim_in_chunks(chunks: &mut std::collections::BTreeMap<usize, usize>, addr: usize, len: usize, granule: usize) -> usize {
    let inside: Vec<(usize, usize)> = chunks.range(addr..addr + len).map(|(&b, &l)| (b, l)).collect();
    inside.iter().map(|&(b, l)| {
        chunks.remove(&b);
        l / granule - 1
    }).sum()
}
