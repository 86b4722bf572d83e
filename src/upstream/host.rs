//! The host upstream: aligned host memory standing in for a device of a fixed capacity.
//!
//! It exists so the pool logic is testable on machines without a GPU and the demo runs
//! anywhere. It never stands in for a GPU test. Its "device" has `capacity` bytes, so
//! out-of-memory paths and percentage limits behave as on a GPU.
//!
//! It is page-mapped like the `vmm` upstream: `decommit` makes pages inaccessible
//! (`PROT_NONE`) and gives their memory to the OS (`MADV_DONTNEED`), `commit` makes them
//! accessible again. A pool bug that hands out a decommitted page therefore crashes the
//! CPU tests instead of passing silently.
//!
//! It also has the virtual memory API of the `arena` strategy (`host_vmm.rs`), drawing on
//! the same capacity, and counts the calls it stands in for as the CUDA upstreams count
//! driver calls.

use super::host_vmm::HostVmm;
use super::{AliasFail, AllocError, DriverCalls, Events, Ipc, Memory, UnmapFail, VirtualMemory, MIN_ALIGN};
use crate::error::Result;
use crate::upstream::stream_id::{StreamHandle, StreamKey, STREAM_PER_THREAD};
use std::alloc::{alloc, dealloc, Layout};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Page size of the host upstream: the GPU's mapping granularity (as the replay's simulated
/// device), so a trace recorded here replays to the same figures.
pub const HOST_PAGE: usize = super::sim::SIM_PAGE;

pub struct HostUpstream {
    capacity: usize,
    /// Bytes taken from the simulated device by every host upstream of that device (the
    /// shards of one device's pool draw on one capacity, as on a GPU).
    device_allocated: Arc<AtomicUsize>,
    /// The part of it this upstream holds (given back when it is dropped).
    allocated: usize,
    /// Decommitted pages (inaccessible; not counted as allocated).
    decommitted: BTreeSet<usize>,
    vmm: HostVmm,
    calls: DriverCalls,
    /// The simulated device (-1: one of its own) and the peers enabled for its memory
    /// (Note [Peer access on demand]): every grant counts them as a GPU's would.
    device: i32,
    peers: Vec<i32>,
    /// Segments handed out, by address: a release must name one exactly, and dropping the
    /// upstream releases what is left, as destroying a CUDA context releases its memory.
    segments: rustc_hash::FxHashMap<usize, usize>,
}

impl HostUpstream {
    /// A simulated device of its own, of `capacity` bytes.
    pub fn new(capacity: usize) -> Self {
        Self::sharing(capacity, Arc::default(), -1)
    }

    /// Simulated device `device` of this process (`capacity` bytes): every upstream made
    /// for it shares its memory.
    pub fn for_device(capacity: usize, device: i32) -> Self {
        static DEVICES: std::sync::Mutex<Vec<(i32, Arc<AtomicUsize>)>> = std::sync::Mutex::new(Vec::new());
        let mut d = DEVICES.lock().unwrap_or_else(|p| p.into_inner());
        let shared = match d.iter().find(|(id, _)| *id == device) {
            Some((_, s)) => s.clone(),
            None => {
                let s = Arc::new(AtomicUsize::new(0));
                d.push((device, s.clone()));
                s
            }
        };
        Self::sharing(capacity, shared, device)
    }

    fn sharing(capacity: usize, device_allocated: Arc<AtomicUsize>, device: i32) -> Self {
        HostUpstream {
            capacity,
            device_allocated,
            allocated: 0,
            decommitted: BTreeSet::new(),
            vmm: HostVmm::new(HOST_PAGE),
            calls: DriverCalls::default(),
            device,
            peers: crate::upstream::peers::enabled(device),
            segments: Default::default(),
        }
    }
}

impl HostUpstream {
    /// Whether the granule of `addr` shows memory now (mapped, or an alias), and the bytes
    /// of memory mapped: what is really mapped, for tests to hold the arena's books against.
    pub fn vmm_is_mapped(&self, addr: usize) -> bool {
        self.vmm.is_mapped(addr)
    }
    pub fn vmm_mapped_bytes(&self) -> usize {
        self.vmm.mapped_bytes()
    }
    /// Address ranges reserved now (count, bytes): the arena's, and one per mapped import.
    pub fn vmm_reserved(&self) -> (usize, usize) {
        self.vmm.reserved_total()
    }
    /// Whether the page at `addr` (page aligned, inside a segment) is decommitted now
    /// (inaccessible), and the bytes of memory this upstream holds (segments less their
    /// decommitted pages, and mapped granules): what is really backed, for tests to hold a
    /// segment pool's books against.
    pub fn is_decommitted(&self, addr: usize) -> bool {
        self.decommitted.contains(&addr)
    }
    pub fn held_bytes(&self) -> usize {
        self.allocated
    }

    /// Take `n` bytes of the device's capacity, if it has them.
    fn take(&mut self, n: usize) -> bool {
        let cap = self.capacity;
        let ok = self.device_allocated.fetch_update(Ordering::AcqRel, Ordering::Acquire, |a| (n <= cap.saturating_sub(a)).then_some(a + n)).is_ok();
        if ok {
            self.allocated += n;
        }
        ok
    }

    fn give(&mut self, n: usize) {
        self.allocated -= n;
        self.device_allocated.fetch_sub(n, Ordering::AcqRel);
    }
}

/// Segments of at least a page are page aligned, so their interior pages are theirs alone.
fn layout(size: usize) -> Option<Layout> {
    let align = if size >= HOST_PAGE { HOST_PAGE } else { MIN_ALIGN };
    Layout::from_size_align(size, align).ok()
}

fn protect(addr: usize, len: usize, prot: libc::c_int) -> Result<()> {
    // SAFETY: the range is whole pages inside a live allocation of ours.
    if unsafe { libc::mprotect(addr as *mut libc::c_void, len, prot) } != 0 {
        return Err(crate::error::Error::Internal(format!(
            "mprotect({addr:#x}, {len}) failed: {}",
            std::io::Error::last_os_error()
        )));
    }
    Ok(())
}

impl HostUpstream {
    /// One access grant, to the device and its enabled peers.
    fn granted(&mut self) {
        self.calls.set_access += 1;
        self.calls.peer_grants += self.peers.len() as u64;
    }

    /// New memory under `[addr, addr + len)`: granule by granule, or one chunk.
    fn map(&mut self, addr: usize, len: usize, chunk: bool) -> std::result::Result<(), AllocError> {
        let n = if chunk { 1 } else { (len / self.vmm.granule()) as u64 };
        if !self.take(len) {
            self.calls.mem_create += 1; // the failing call
            return Err(AllocError::OutOfMemory);
        }
        let r = if chunk { self.vmm.map_chunk(addr, len) } else { self.vmm.map_new(addr, len) };
        if let Err(e) = r {
            self.give(len);
            return Err(e.into());
        }
        (self.calls.mem_create, self.calls.mem_map) = (self.calls.mem_create + n, self.calls.mem_map + n);
        self.granted();
        Ok(())
    }
}

impl Memory for HostUpstream {
    fn name(&self) -> &'static str {
        "host"
    }

    fn allocate(&mut self, size: usize, _stream: StreamHandle) -> std::result::Result<usize, AllocError> {
        self.calls.malloc += 1;
        let Some(layout) = layout(size).filter(|_| size != 0) else { return Err(AllocError::OutOfMemory) };
        if !self.take(size) {
            return Err(AllocError::OutOfMemory);
        }
        // SAFETY: size > 0 checked above.
        let p = unsafe { alloc(layout) };
        if p.is_null() {
            self.give(size);
            return Err(AllocError::OutOfMemory);
        }
        self.segments.insert(p as usize, size);
        Ok(p as usize)
    }

    fn deallocate(&mut self, addr: usize, size: usize, _stream: StreamHandle) -> Result<()> {
        self.calls.free += 1;
        if self.segments.get(&addr) != Some(&size) {
            return Err(crate::error::Error::Internal(format!("host upstream: release of {addr:#x}+{size}, which it did not hand out")));
        }
        self.segments.remove(&addr);
        // Decommitted pages become ordinary memory again before the allocator reuses them.
        let holes: Vec<usize> = self.decommitted.range(addr..addr + size).copied().collect();
        for &p in &holes {
            protect(p, HOST_PAGE, libc::PROT_READ | libc::PROT_WRITE)?;
            self.decommitted.remove(&p);
        }
        let layout = layout(size).expect("the pool hands back sizes that allocate accepted");
        // SAFETY: the pool only hands back (addr, size) pairs that `allocate` returned.
        unsafe { dealloc(addr as *mut u8, layout) };
        self.give(size - holes.len() * HOST_PAGE);
        Ok(())
    }

    fn page_size(&self) -> usize {
        HOST_PAGE
    }

    fn commit(&mut self, addr: usize, len: usize) -> std::result::Result<(), AllocError> {
        self.calls.mem_map += 1;
        if !self.take(len) {
            return Err(AllocError::OutOfMemory);
        }
        if let Err(e) = protect(addr, len, libc::PROT_READ | libc::PROT_WRITE) {
            self.give(len);
            return Err(e.into());
        }
        for p in (addr..addr + len).step_by(HOST_PAGE) {
            self.decommitted.remove(&p);
        }
        Ok(())
    }

    fn decommit(&mut self, addr: usize, len: usize) -> std::result::Result<(), UnmapFail> {
        self.calls.mem_unmap += 1;
        // Page by page, as the `vmm` upstream unmaps: a failure says exactly which pages
        // before it are inaccessible.
        for p in (addr..addr + len).step_by(HOST_PAGE) {
            if self.decommitted.contains(&p) {
                continue;
            }
            protect(p, HOST_PAGE, libc::PROT_NONE).map_err(|error| UnmapFail { unmapped: p - addr, leaked: 0, error })?;
            // SAFETY: a whole page of ours, now inaccessible; its contents are discarded.
            unsafe { libc::madvise(p as *mut libc::c_void, HOST_PAGE, libc::MADV_DONTNEED) };
            self.decommitted.insert(p);
            self.give(HOST_PAGE);
        }
        Ok(())
    }

    fn mem_info(&mut self) -> Result<(usize, usize)> {
        Ok((self.capacity.saturating_sub(self.device_allocated.load(Ordering::Acquire)), self.capacity))
    }

    fn driver_calls(&self) -> DriverCalls {
        DriverCalls { host_alloc: self.vmm.backup_allocs, ..self.calls }
    }
}

impl VirtualMemory for HostUpstream {
    fn vmm_granule(&mut self) -> usize {
        self.vmm.granule()
    }

    fn vmm_set_granule(&mut self, bytes: usize) -> usize {
        self.vmm.set_granule(bytes)
    }

    fn vmm_device_granule(&self) -> usize {
        self.vmm.device_granule()
    }

    fn vmm_reserve(&mut self, len: usize) -> Result<usize> {
        self.calls.address_reserve += 1;
        self.vmm.reserve(len)
    }

    fn vmm_unreserve(&mut self, base: usize, len: usize) -> Result<()> {
        self.calls.address_free += 1;
        self.vmm.unreserve(base, len)
    }

    fn vmm_map_new(&mut self, addr: usize, len: usize) -> std::result::Result<(), AllocError> {
        self.map(addr, len, false)
    }

    fn vmm_map_chunk(&mut self, addr: usize, len: usize) -> std::result::Result<(), AllocError> {
        self.map(addr, len, true)
    }

    fn vmm_unmap(&mut self, addr: usize, len: usize) -> std::result::Result<(), UnmapFail> {
        // What went back before a failure is counted and given back too (the file's pages
        // are released with the address: the host never leaks one).
        let n = self.vmm.allocations_in(addr, len);
        let r = self.vmm.unmap(addr, len);
        let gone = r.as_ref().map_or_else(|f| f.unmapped, |()| len);
        let n = if gone == len { n } else { self.vmm.allocations_in(addr, gone).min(n) } as u64;
        self.calls.mem_unmap += n;
        self.calls.mem_release += n;
        self.give(gone);
        r
    }

    fn vmm_pause(&mut self, _after: Option<super::EventHandle>, backup: bool) -> Result<usize> {
        let bytes = self.vmm.pause(backup)?;
        self.give(bytes);
        Ok(bytes)
    }

    fn vmm_resume(&mut self) -> std::result::Result<usize, AllocError> {
        let bytes = self.vmm.paused_bytes();
        if !self.take(bytes) {
            return Err(AllocError::OutOfMemory);
        }
        let r = self.vmm.resume().map_err(|e| {
            self.give(bytes);
            AllocError::from(e)
        });
        if r.is_ok() {
            self.granted();
        }
        r
    }

    fn vmm_enable_peer(&mut self, peer: i32) -> Result<usize> {
        // (-1, every peer: a simulated device knows none.)
        if peer == -1 || peer == self.device || self.peers.contains(&peer) {
            return Ok(0);
        }
        if self.device < 0 || !(0..crate::upstream::peers::MAX_PEER_DEVICES as i32).contains(&peer) {
            return Err(crate::error::Error::InvalidArgument(format!(
                "peer access: device {peer} cannot access device {}'s memory (no such simulated device)",
                self.device
            )));
        }
        let grants = self.vmm.mappings();
        self.calls.set_access += grants as u64;
        self.calls.peer_grants += grants as u64;
        self.peers.push(peer);
        Ok(grants)
    }

    fn vmm_paused_bytes(&self) -> usize {
        self.vmm.paused_bytes()
    }

    fn vmm_is_paused(&self) -> bool {
        self.vmm.is_paused()
    }

    fn vmm_prepare_backup(&mut self) -> Result<usize> {
        self.vmm.prepare_backup()
    }

    fn vmm_drop_backup(&mut self) -> usize {
        self.vmm.drop_backup()
    }

    fn vmm_alias(&mut self, homes: &[usize], to: usize) -> std::result::Result<(), AliasFail> {
        let g = self.vmm.granule();
        let mut i = 0;
        while i < homes.len() {
            let Some(n) = self.vmm.whole_allocation_at(homes, i) else {
                let error = crate::error::Error::Internal(format!("host vmm: alias of {:#x}, which is not the start of a whole chunk", homes[i]));
                return Err(AliasFail { made: i, error });
            };
            for k in 0..n {
                if let Err(error) = self.vmm.alias(homes[i + k], to + (i + k) * g) {
                    // The chunk's aliases made so far go: `made` counts whole allocations.
                    if k > 0 {
                        let _ = self.vmm.unalias(to + i * g, k * g);
                    }
                    return Err(AliasFail { made: i, error });
                }
            }
            self.vmm.note_alias_chunk(to + i * g, n * g);
            self.calls.mem_map += 1;
            i += n;
        }
        self.granted();
        Ok(())
    }

    fn vmm_unalias(&mut self, addr: usize, len: usize) -> Result<()> {
        let n = self.vmm.alias_mappings_in(addr, len);
        self.vmm.unalias(addr, len)?;
        self.calls.mem_unmap += n as u64;
        Ok(())
    }

    /// The host's granules are memfd offsets, shared as file descriptors.
    fn vmm_memory_kind(&self) -> String {
        "posix_fd".into()
    }
}

impl Ipc for HostUpstream {
    fn vmm_share_kind(&self) -> u32 {
        crate::share::protocol::KIND_HOST
    }

    fn vmm_export(&mut self, addr: usize) -> Result<crate::share::protocol::SharedGranule> {
        self.calls.shareable += 1;
        self.vmm.export(addr)
    }

    fn vmm_import(&mut self, d: &crate::share::protocol::GranuleDescriptor, fds: &crate::share::protocol::FdSource) -> Result<usize> {
        let ptr = self.vmm.import(d, fds)?;
        let n = d.granules.len() as u64;
        (self.calls.address_reserve, self.calls.shareable, self.calls.mem_map) =
            (self.calls.address_reserve + 1, self.calls.shareable + n, self.calls.mem_map + n);
        self.granted();
        Ok(ptr)
    }

    fn vmm_unimport(&mut self, ptr: usize) -> Result<bool> {
        let Some(n) = self.vmm.unimport(ptr) else { return Ok(false) };
        (self.calls.mem_unmap, self.calls.address_free) = (self.calls.mem_unmap + n as u64, self.calls.address_free + 1);
        Ok(true)
    }

    fn vmm_imports(&self) -> usize {
        self.vmm.imports()
    }

    fn vmm_import_bytes(&self) -> usize {
        self.vmm.import_bytes()
    }
}

impl Events for HostUpstream {
    // Events: the host "device" has finished everything at once. The calls are counted as
    // the CUDA upstream's would be, so tests can tell a hot path that makes them.
    fn event_record(&mut self, _ev: super::EventHandle, _stream: StreamHandle) -> Result<()> {
        self.calls.event_record += 1;
        Ok(())
    }
    fn event_query(&mut self, _ev: super::EventHandle) -> Result<bool> {
        self.calls.event_query += 1;
        Ok(true)
    }
    fn event_synchronize(&mut self, _ev: super::EventHandle) -> Result<()> {
        self.calls.event_sync += 1;
        Ok(())
    }
    fn stream_wait_event(&mut self, _stream: StreamHandle, _ev: super::EventHandle) -> Result<()> {
        self.calls.stream_wait += 1;
        Ok(())
    }

    fn stream_key(&mut self, handle: StreamHandle) -> Result<StreamKey> {
        self.calls.stream_id += 1;
        if handle == STREAM_PER_THREAD {
            // One per-thread stream per OS thread, as in CUDA.
            return Ok(StreamKey(0x8000_0000_0000_0000 | unsafe { libc::pthread_self() } as u64 >> 1));
        }
        Ok(StreamKey(handle as u64))
    }
}

impl Drop for HostUpstream {
    fn drop(&mut self) {
        // What the pool still holds (live blocks of a pool dropped with allocations
        // outstanding) goes back with the "device".
        for (addr, size) in std::mem::take(&mut self.segments) {
            let holes: Vec<usize> = self.decommitted.range(addr..addr + size).copied().collect();
            for p in holes {
                let _ = protect(p, HOST_PAGE, libc::PROT_READ | libc::PROT_WRITE);
                self.decommitted.remove(&p);
            }
            if let Some(layout) = layout(size) {
                // SAFETY: `(addr, size)` came from `allocate` and was not released.
                unsafe { dealloc(addr as *mut u8, layout) };
            }
        }
        // Whatever this upstream still held (segments above, granules still mapped) is the
        // simulated device's again.
        self.device_allocated.fetch_sub(self.allocated, Ordering::AcqRel);
    }
}
