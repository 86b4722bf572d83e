//! The host upstream's virtual memory API: a CPU stand-in for CUDA's `cuMemAddressReserve` /
//! `cuMemCreate` / `cuMemMap` / `cuMemUnmap` / `cuMemRelease`, so the arena's logic runs in
//! tests without a GPU.
//!
//! Physical memory is a `memfd` file: a granule of physical memory is a granule-sized
//! offset in it, mapped `MAP_SHARED` at any address, so a granule mapped at a second
//! address (an alias) shows the same bytes, as a CUDA allocation handle mapped twice does. Reserved address space is
//! `PROT_NONE`: touching an unmapped granule crashes the test instead of passing silently.
//! Released granules are punched out of the file (`FALLOC_FL_PUNCH_HOLE`), giving the memory
//! back to the OS.
//!
//! A chunk (`map_chunk`: one allocation of several granules on a GPU) is booked as such,
//! and unmapping or aliasing part of one is refused as the driver refuses it, so the CPU
//! tests catch a pool that would cut one.
//!
//! Sharing with another process (`crate::share::protocol`) works as on the GPU: a
//! granule is exported as the file's descriptor and the granule's offset in it, and an
//! importer maps those offsets of its copy of the descriptor side by side.

use crate::share::protocol::{GranuleDescriptor, FdSource};
use crate::upstream::UnmapFail;
use crate::error::{Error, Result};
use rustc_hash::FxHashMap;
use std::collections::BTreeMap;
mod pause;

pub struct HostVmm {
    /// Bytes of each mapping (`set_granule`: a multiple of the device's).
    granule: usize,
    /// The granularity exports list and imports map in.
    device_granule: usize,
    /// The "physical memory": created on first use.
    fd: Option<libc::c_int>,
    file_len: usize,
    /// File offsets of released granules, for reuse.
    spare_offsets: Vec<usize>,
    /// Mapped granule address -> its offset in the file.
    mapped: FxHashMap<usize, usize>,
    /// Alias address -> the home granule whose memory it shows.
    aliases: FxHashMap<usize, usize>,
    /// Chunks (allocations of several granules), and alias mappings of them: base -> bytes.
    chunks: BTreeMap<usize, usize>,
    alias_chunks: BTreeMap<usize, usize>,
    /// Reservation base -> length.
    reservations: FxHashMap<usize, usize>,
    /// Ranges mapping another process's granules (`import`): base -> (granules, the
    /// address `import` returned, which alone closes it).
    imports: BTreeMap<usize, (usize, usize)>,
    /// What a pause released (`host_vmm/pause.rs`), until the resume.
    paused: Option<pause::HostPaused>,
    /// The backup buffer kept between pauses (`prepare_backup`, a resume), and how many
    /// times one was allocated (the stand-in's count of `cuMemHostAlloc`).
    kept_backup: Option<Vec<u8>>,
    pub backup_allocs: u64,
}

fn os_error(what: &str) -> Error {
    Error::Internal(format!("host vmm: {what} failed: {}", std::io::Error::last_os_error()))
}

impl HostVmm {
    pub fn new(granule: usize) -> HostVmm {
        HostVmm {
            granule,
            device_granule: granule,
            fd: None,
            file_len: 0,
            spare_offsets: Vec::new(),
            mapped: FxHashMap::default(),
            aliases: FxHashMap::default(),
            chunks: BTreeMap::new(),
            alias_chunks: BTreeMap::new(),
            reservations: FxHashMap::default(),
            imports: BTreeMap::new(),
            paused: None,
            kept_backup: None,
            backup_allocs: 0,
        }
    }

    pub fn granule(&self) -> usize {
        self.granule
    }

    /// The mappings a peer enabled now is granted, one grant each as on a GPU (Note [Peer
    /// access on demand]): the granules mapped at home, their aliases (none while paused:
    /// the resume grants them), and the imports.
    pub fn mappings(&self) -> usize {
        let aliases = if self.paused.is_some() { 0 } else { self.aliases.len() };
        self.mapped.len() + aliases + self.imports.len()
    }

    pub fn device_granule(&self) -> usize {
        self.device_granule
    }

    /// Make each mapping `bytes` (a power-of-two multiple of the device granule; anything
    /// else keeps the granule). Only while nothing is reserved.
    pub fn set_granule(&mut self, bytes: usize) -> usize {
        let g = self.device_granule;
        if bytes.is_power_of_two() && bytes >= g && bytes % g == 0 && self.reservations.is_empty() {
            self.granule = bytes;
        }
        self.granule
    }

    /// Bytes of physical memory mapped now.
    pub fn mapped_bytes(&self) -> usize {
        self.mapped.len() * self.granule
    }

    fn fd(&mut self) -> Result<libc::c_int> {
        if let Some(fd) = self.fd {
            return Ok(fd);
        }
        // SAFETY: a NUL-terminated name; flags are valid.
        let fd = unsafe { libc::memfd_create(c"gpupool-host-vmm".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(os_error("memfd_create"));
        }
        self.fd = Some(fd);
        Ok(fd)
    }

    pub fn reserve(&mut self, len: usize) -> Result<usize> {
        let g = self.granule;
        // Over-reserve by a granule, then trim, so the range is granule aligned.
        // SAFETY: an anonymous, inaccessible mapping at an address of the kernel's choice.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len + g,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_error("mmap (reserve)"));
        }
        let start = p as usize;
        let base = (start + g - 1) & !(g - 1);
        // SAFETY: trimming the parts of our own fresh mapping outside [base, base + len).
        unsafe {
            if base > start {
                libc::munmap(p, base - start);
            }
            let end = start + len + g;
            if end > base + len {
                libc::munmap((base + len) as *mut libc::c_void, end - (base + len));
            }
        }
        self.reservations.insert(base, len);
        Ok(base)
    }

    pub fn unreserve(&mut self, base: usize, len: usize) -> Result<()> {
        if self.reservations.get(&base) != Some(&len) {
            return Err(Error::Internal(format!("host vmm: {base:#x}+{len} is not a reservation")));
        }
        if self.mapped.keys().chain(self.aliases.keys()).any(|&a| a >= base && a < base + len) {
            return Err(Error::Internal(format!("host vmm: reservation {base:#x} still has mapped granules")));
        }
        self.reservations.remove(&base);
        // SAFETY: our own reservation, nothing mapped in it.
        unsafe { libc::munmap(base as *mut libc::c_void, len) };
        Ok(())
    }

    fn reserved(&self, addr: usize, len: usize) -> bool {
        self.reservations.iter().any(|(&b, &l)| addr >= b && addr + len <= b + l)
    }

    /// Map the file's granule at `off` over `addr`.
    fn map_at(&mut self, addr: usize, off: usize) -> Result<()> {
        let fd = self.fd()?;
        // SAFETY: `addr` is a granule of our own reservation (checked by the callers).
        let p = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                self.granule,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd,
                off as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_error("mmap (map)"));
        }
        self.mapped.insert(addr, off);
        Ok(())
    }

    /// Put inaccessible reserved space back over `addr` (the granule stays reserved).
    fn unmap_at(&mut self, addr: usize) -> Result<()> {
        // SAFETY: a granule of our own reservation.
        let p = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                self.granule,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_error("mmap (unmap)"));
        }
        self.mapped.remove(&addr);
        Ok(())
    }

    fn new_offset(&mut self) -> Result<usize> {
        if let Some(off) = self.spare_offsets.pop() {
            return Ok(off);
        }
        let fd = self.fd()?;
        let off = self.file_len;
        // SAFETY: growing our own file.
        if unsafe { libc::ftruncate(fd, (off + self.granule) as libc::off_t) } != 0 {
            return Err(os_error("ftruncate"));
        }
        self.file_len += self.granule;
        Ok(off)
    }

    fn release_offset(&mut self, off: usize) {
        if let Some(fd) = self.fd {
            // SAFETY: punching a hole in our own file gives its pages back; the size stays.
            unsafe {
                libc::fallocate(
                    fd,
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    off as libc::off_t,
                    self.granule as libc::off_t,
                )
            };
        }
        self.spare_offsets.push(off);
    }

    /// Map new memory over every granule of `[addr, addr + len)`; all or nothing.
    pub fn map_new(&mut self, addr: usize, len: usize) -> Result<()> {
        // Over an alias too: the driver refuses to map over any existing mapping.
        if !self.reserved(addr, len)
            || (addr..addr + len).step_by(self.granule).any(|a| self.mapped.contains_key(&a) || self.aliases.contains_key(&a))
        {
            return Err(Error::Internal(format!("host vmm: map of {addr:#x}+{len}: not reserved, or mapped already")));
        }
        let mut done = Vec::new();
        for a in (addr..addr + len).step_by(self.granule) {
            let res = self.new_offset().and_then(|off| {
                self.map_at(a, off).inspect_err(|_| self.spare_offsets.push(off))
            });
            if let Err(e) = res {
                for d in done {
                    let _ = self.unmap(d, self.granule);
                }
                return Err(e);
            }
            done.push(a);
        }
        Ok(())
    }

    /// Map new memory over `[addr, addr + len)` as one chunk; all or nothing.
    pub fn map_chunk(&mut self, addr: usize, len: usize) -> Result<()> {
        self.map_new(addr, len)?;
        if len > self.granule {
            self.chunks.insert(addr, len);
        }
        Ok(())
    }

    /// The chunk holding `addr`, if it is in one: (base, bytes).
    fn chunk_of(map: &BTreeMap<usize, usize>, addr: usize) -> Option<(usize, usize)> {
        map.range(..=addr).next_back().filter(|(&b, &l)| addr < b + l).map(|(&b, &l)| (b, l))
    }

    /// Allocations (granules, or chunks counted once) in `[addr, addr + len)`, for the
    /// driver-call counts.
    pub fn allocations_in(&self, addr: usize, len: usize) -> usize {
        let in_chunks: usize = self.chunks.range(addr..addr + len).map(|(_, &l)| l / self.granule - 1).sum();
        len / self.granule - in_chunks
    }

    /// Alias mappings in `[addr, addr + len)` (chunk aliases counted once).
    pub fn alias_mappings_in(&self, addr: usize, len: usize) -> usize {
        let in_chunks: usize = self.alias_chunks.range(addr..addr + len).map(|(_, &l)| l / self.granule - 1).sum();
        len / self.granule - in_chunks
    }

    /// Unmap and release every granule of `[addr, addr + len)`, in order. A failure says
    /// how many bytes before it are gone. Releasing cannot fail here (a hole the kernel will
    /// not punch leaves the offset reused all the same), so nothing is ever leaked.
    pub fn unmap(&mut self, addr: usize, len: usize) -> std::result::Result<(), UnmapFail> {
        for a in (addr..addr + len).step_by(self.granule) {
            let fail = |error| UnmapFail { unmapped: a - addr, leaked: 0, error };
            if let Some((b, l)) = Self::chunk_of(&self.chunks, a) {
                if b < addr || b + l > addr + len {
                    return Err(fail(Error::Internal(format!("host vmm: unmap of {addr:#x}+{len:#x} cuts the chunk {b:#x}+{l:#x}"))));
                }
                if b == a && (a..a + l).step_by(self.granule).any(|x| self.aliases.values().any(|&h| h == x)) {
                    return Err(fail(Error::Internal(format!("host vmm: unmap of chunk {a:#x}, which still has an alias"))));
                }
            }
            let Some(&off) = self.mapped.get(&a) else {
                return Err(fail(Error::Internal(format!("host vmm: unmap of {a:#x}, which is not mapped"))));
            };
            if self.aliases.values().any(|&h| h == a) {
                return Err(fail(Error::Internal(format!("host vmm: unmap of {a:#x}, which still has an alias"))));
            }
            self.unmap_at(a).map_err(fail)?;
            if let Some(fd) = self.fd {
                // Exports of it end before its offset can back another granule.
                crate::share::protocol::ExportRecord::granule_released(fd, off as u64);
            }
            self.release_offset(off);
            if let Some((b, l)) = Self::chunk_of(&self.chunks, a).filter(|&(b, l)| a + self.granule == b + l) {
                debug_assert!(l > self.granule);
                self.chunks.remove(&b);
            }
        }
        Ok(())
    }

    /// Whether `homes[i..]` starts with a whole allocation (a granule, or a chunk's
    /// granules in order from its first), and its granules.
    pub fn whole_allocation_at(&self, homes: &[usize], i: usize) -> Option<usize> {
        let g = self.granule;
        match Self::chunk_of(&self.chunks, homes[i]) {
            None => Some(1),
            Some((b, l)) => (b == homes[i] && i + l / g <= homes.len() && (0..l / g).all(|k| homes[i + k] == b + k * g)).then_some(l / g),
        }
    }

    /// `[to, to + len)` aliases a whole chunk (booked so it is removed whole).
    pub fn note_alias_chunk(&mut self, to: usize, len: usize) {
        if len > self.granule {
            self.alias_chunks.insert(to, len);
        }
    }

    /// How many address ranges are reserved, and their bytes (the pool's own and those of
    /// mapped imports), for tests that check a failed import leaves none behind.
    pub fn reserved_total(&self) -> (usize, usize) {
        (self.reservations.len(), self.reservations.values().sum())
    }

    /// Whether `addr`'s granule shows memory now (a home or an alias), for tests that check
    /// the arena's books against what is really mapped.
    pub fn is_mapped(&self, addr: usize) -> bool {
        let g = addr & !(self.granule - 1);
        self.mapped.contains_key(&g) || self.aliases.contains_key(&g)
    }

    /// Map the granule mapped at `home` at `to` too: the same bytes at both addresses.
    pub fn alias(&mut self, home: usize, to: usize) -> Result<()> {
        let Some(&off) = self.mapped.get(&home) else {
            return Err(Error::Internal(format!("host vmm: alias of {home:#x}, which is not mapped")));
        };
        if !self.reserved(to, self.granule) || self.mapped.contains_key(&to) || self.aliases.contains_key(&to) {
            return Err(Error::Internal(format!("host vmm: alias at {to:#x}: not reserved, or mapped")));
        }
        self.map_at(to, off)?;
        self.mapped.remove(&to); // `map_at` books homes; an alias is booked apart
        self.aliases.insert(to, home);
        Ok(())
    }

    /// Remove the aliases in `[addr, addr + len)` (whole alias mappings).
    pub fn unalias(&mut self, addr: usize, len: usize) -> Result<()> {
        for at in [addr, addr + len - 1] {
            if let Some((b, l)) = Self::chunk_of(&self.alias_chunks, at) {
                if b < addr || b + l > addr + len {
                    return Err(Error::Internal(format!("host vmm: unalias of {addr:#x}+{len:#x} cuts the chunk alias {b:#x}+{l:#x}")));
                }
            }
        }
        let whole: Vec<usize> = self.alias_chunks.range(addr..addr + len).map(|(&b, _)| b).collect();
        if let Some(a) = (addr..addr + len).step_by(self.granule).find(|a| !self.aliases.contains_key(a)) {
            return Err(Error::Internal(format!("host vmm: unalias of {a:#x}, which is no alias")));
        }
        // Booked after the check, so a refused call changes nothing.
        for b in whole {
            self.alias_chunks.remove(&b);
        }
        for a in (addr..addr + len).step_by(self.granule) {
            if self.aliases.remove(&a).is_none() {
                return Err(Error::Internal(format!("host vmm: unalias of {a:#x}, which is no alias")));
            }
            self.unmap_at(a)?;
        }
        Ok(())
    }
}

impl HostVmm {
    /// The granule mapped at `addr` (a home or an alias) as another process sees it: the
    /// file's descriptor and the granule's offset in the file.
    pub fn export(&mut self, addr: usize) -> Result<crate::share::protocol::SharedGranule> {
        let home = self.aliases.get(&addr).copied().unwrap_or(addr);
        let Some(&off) = self.mapped.get(&home) else {
            return Err(Error::Internal(format!("host vmm: export of {addr:#x}, which is not mapped")));
        };
        Ok(crate::share::protocol::SharedGranule { fd: self.fd()?, offset: off as u64, ..Default::default() })
    }

    /// Map the granules of `d` (offsets in the files behind the descriptors `fds` yields)
    /// side by side in a new reservation; returns the block's address there. All or nothing.
    pub fn import(&mut self, d: &GranuleDescriptor, fds: &FdSource) -> Result<usize> {
        // Exports list the device granule whatever the exporter's granule.
        let g = self.device_granule;
        if d.granule != g as u64 {
            return Err(Error::InvalidArgument(format!("IPC import: the exporter's granule is {} bytes, this upstream's {g}", d.granule)));
        }
        let n = d.granules.len();
        let base = self.reserve(n * g)?;
        let undo = |v: &mut HostVmm| {
            v.reservations.remove(&base);
            // SAFETY: the reservation made above, with what was mapped in it.
            unsafe { libc::munmap(base as *mut libc::c_void, n * g) };
        };
        for (i, shared) in d.granules.iter().enumerate() {
            let fd = match fds.get(i, shared) {
                Ok(got) => got,
                Err(e) => {
                    undo(self);
                    return Err(e);
                }
            };
            // SAFETY: a granule of the reservation just made; the file and offset are the
            // caller's (a bad one fails here and nothing stays mapped).
            let p = unsafe {
                libc::mmap(
                    (base + i * g) as *mut libc::c_void,
                    g,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED | libc::MAP_FIXED,
                    fd.0,
                    shared.offset as libc::off_t,
                )
            };
            if p == libc::MAP_FAILED {
                let e = std::io::Error::last_os_error();
                undo(self);
                // The descriptor or offset came from the caller: their error, not ours.
                return Err(Error::InvalidArgument(format!(
                    "IPC import: granule {i} (descriptor {}, offset {}) cannot be mapped: {e}",
                    fd.0, shared.offset
                )));
            }
        }
        let ptr = base + d.offset as usize;
        self.imports.insert(base, (n, ptr));
        Ok(ptr)
    }

    /// Unmap the range `import` returned `ptr` for; its granules, or `None` when `ptr`
    /// is no such address.
    pub fn unimport(&mut self, ptr: usize) -> Option<usize> {
        // The block may start past the range's first granule (a chunk listed whole).
        let (&base, &(n, returned)) = self.imports.range(..=ptr).next_back()?;
        if returned != ptr {
            return None;
        }
        self.imports.remove(&base);
        self.reservations.remove(&base);
        // SAFETY: the whole range `import` mapped.
        unsafe { libc::munmap(base as *mut libc::c_void, n * self.device_granule) };
        Some(n)
    }

    pub fn imports(&self) -> usize {
        self.imports.len()
    }

    /// Address space the mapped imports hold.
    pub fn import_bytes(&self) -> usize {
        self.imports.values().map(|&(n, _)| n * self.device_granule).sum()
    }
}

impl Drop for HostVmm {
    fn drop(&mut self) {
        // Live blocks of a dropped pool stay readable until the process ends (as on a
        // GPU, where the driver keeps memory until the context goes); only the file
        // descriptor closes, the mappings keep the memory.
        if let Some(fd) = self.fd.take() {
            // Every export of this file ends before its number can be reused.
            for off in self.mapped.values() {
                crate::share::protocol::ExportRecord::granule_released(fd, *off as u64);
            }
            // SAFETY: our own descriptor.
            unsafe { libc::close(fd) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_alias_unmap_shares_bytes_and_protects_unmapped_space() {
        let g = 2 << 20;
        let mut v = HostVmm::new(g);
        let base = v.reserve(8 * g).unwrap();
        assert_eq!(base % g, 0);
        v.map_new(base, 2 * g).unwrap();
        assert_eq!(v.mapped_bytes(), 2 * g);
        unsafe { *((base + g + 5) as *mut u8) = 42 };
        v.alias(base + g, base + 5 * g).unwrap();
        assert_eq!(unsafe { *((base + 5 * g + 5) as *const u8) }, 42, "the alias shows the home's bytes");
        unsafe { *((base + 5 * g + 6) as *mut u8) = 43 };
        assert_eq!(unsafe { *((base + g + 6) as *const u8) }, 43, "and writes through to it");
        assert!(v.map_new(base, g).is_err(), "mapped twice");
        assert!(v.unmap(base + g, g).is_err(), "a home with an alias stays");
        assert!(v.unreserve(base, 8 * g).is_err(), "still mapped");
        v.unalias(base + 5 * g, g).unwrap();
        assert!(v.unalias(base + 5 * g, g).is_err());
        v.unmap(base, 2 * g).unwrap();
        assert_eq!(v.mapped_bytes(), 0);
        // A released granule's offset is reused, not grown.
        v.map_new(base + 3 * g, g).unwrap();
        assert_eq!(v.file_len, 2 * g);
        v.unmap(base + 3 * g, g).unwrap();
        v.unreserve(base, 8 * g).unwrap();
    }
}
