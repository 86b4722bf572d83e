//! Pausing the arena's memory (`docs/tags.md`): every physical allocation this address
//! space maps is copied to page-locked host memory where asked, unmapped (at its home and
//! at every alias) and released, while the address ranges stay reserved; resuming creates
//! new allocations of the same sizes, maps them at the same addresses and aliases, and
//! copies the contents back. Pointers, CUDA graphs and anything else that holds addresses
//! see the same memory after a resume.
//!
//! The copies go on a stream of this address space's own, which first waits for the
//! caller's event (a stream-ordered wait; the host waits for the copy alone before the
//! unmap, never for the whole device). The host buffer is kept after a resume for the next
//! pause (a trainer and a rollout engine switch every step, and page-locking tens of
//! gigabytes costs more than copying them); `drop_backup` gives it back.

use super::super::driver::{check, cuda_error};
use super::CudaVmm;
use crate::error::{Error, Result};
use crate::upstream::{AllocError, DriverCalls, EventHandle};
use cudarc::driver::sys;

/// What a pause released, for the resume.
#[derive(Default)]
pub struct PausedSpace {
    /// Allocations: (base, bytes, released), in address order.
    homes: Vec<(usize, usize, bool)>,
    /// Alias mappings: (start, bytes, base of the allocation shown, unmapped).
    aliases: Vec<(usize, usize, usize, bool)>,
    /// Whether the host buffer holds the homes' contents, in their order.
    backed_up: bool,
}

/// Page-locked host memory for the contents of paused allocations.
pub struct HostBackup {
    ptr: *mut u8,
    len: usize,
}

/// Copies of at most this many bytes each: a long run is cut so one copy's failure says
/// where, and the driver's queue stays short.
const COPY_PIECE: usize = 1 << 30;

/// Runs of address-adjacent allocations among `homes` (only those `pick` selects), each as
/// (address, bytes, offset in the host buffer).
fn runs(homes: &[(usize, usize, bool)], pick: impl Fn(bool) -> bool) -> Vec<(usize, usize, usize)> {
    let mut out: Vec<(usize, usize, usize)> = Vec::new();
    let mut offset = 0;
    for &(base, len, released) in homes {
        if pick(released) {
            match out.last_mut() {
                Some(r) if r.0 + r.1 == base && r.2 + r.1 == offset && r.1 + len <= COPY_PIECE => r.1 += len,
                _ => out.push((base, len, offset)),
            }
        }
        offset += len;
    }
    out
}

/// A resume maps and copies at most this many bytes at a time: the copy of one batch runs
/// while the next is created and mapped.
const RESUME_BATCH: usize = 64 << 20;

/// The released `homes` in batches a resume maps together: consecutive homes of one size,
/// address-adjacent, up to `RESUME_BATCH` bytes (one home at least), each as (address,
/// bytes, bytes per allocation, offset in the host buffer).
fn resume_batches(homes: &[(usize, usize, bool)]) -> Vec<(usize, usize, usize, usize)> {
    let mut out: Vec<(usize, usize, usize, usize)> = Vec::new();
    let mut offset = 0;
    let mut joinable = false; // the previous home was released and closed no batch
    for &(base, len, released) in homes {
        if released {
            match out.last_mut() {
                Some(b) if joinable && b.0 + b.1 == base && b.2 == len && b.1 + len <= RESUME_BATCH => b.1 += len,
                _ => out.push((base, len, len, offset)),
            }
        }
        joinable = released;
        offset += len;
    }
    out
}

impl CudaVmm {
    /// Bytes of device memory a pause released and a resume has not mapped again.
    pub fn paused_bytes(&self) -> usize {
        self.paused.as_ref().map_or(0, |p| p.homes.iter().filter(|h| h.2).map(|h| h.1).sum())
    }

    pub fn is_paused(&self) -> bool {
        self.paused.is_some()
    }

    /// The copy stream, made on first use.
    fn copy_stream(&mut self) -> Result<sys::CUstream> {
        if self.copy_stream.is_null() {
            let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
            check("cuStreamCreate", unsafe { sys::cuStreamCreate(&mut self.copy_stream, flags) })?;
        }
        Ok(self.copy_stream)
    }

    /// A host buffer of at least `len` bytes (the kept one when it is large enough).
    fn host_buffer(&mut self, len: usize, calls: &mut DriverCalls) -> Result<*mut u8> {
        if self.backup.as_ref().is_some_and(|b| b.len >= len) {
            return Ok(self.backup.as_ref().map_or(std::ptr::null_mut(), |b| b.ptr));
        }
        self.drop_backup();
        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
        calls.host_alloc += 1;
        let r = unsafe { sys::cuMemHostAlloc(&mut p, len.max(1), sys::CU_MEMHOSTALLOC_PORTABLE) };
        if r != sys::CUresult::CUDA_SUCCESS {
            // Nothing was unmapped yet: the pause is refused and nothing changed.
            return Err(cuda_error("cuMemHostAlloc", r));
        }
        self.backup = Some(HostBackup { ptr: p.cast(), len });
        Ok(p.cast())
    }

    /// Make the kept host buffer as large as what is mapped now (`VirtualMemory::
    /// vmm_prepare_backup`); returns its bytes. Refused while paused (the buffer may hold
    /// the contents).
    pub fn prepare_backup(&mut self, calls: &mut DriverCalls) -> Result<usize> {
        if self.paused.is_some() {
            return Err(Error::InvalidArgument("prepare_backup: this memory is paused; resume it first".into()));
        }
        let total: usize = self.handles.values().map(|&(_, l)| l).sum();
        if total == 0 {
            return Ok(self.backup.as_ref().map_or(0, |b| b.len));
        }
        self.host_buffer(total, calls)?;
        Ok(self.backup.as_ref().map_or(0, |b| b.len))
    }

    /// Give the kept host buffer back; returns its bytes.
    pub fn drop_backup(&mut self) -> usize {
        if self.paused.as_ref().is_some_and(|p| p.backed_up) {
            return 0; // it holds a paused tag's contents
        }
        match self.backup.take() {
            Some(b) => {
                // SAFETY: memory `cuMemHostAlloc` gave us, no copy in flight (copies are
                // waited for before pause and resume return).
                unsafe { sys::cuMemFreeHost(b.ptr.cast()) };
                b.len
            }
            None => 0,
        }
    }

    /// Pause every allocation mapped here (module docs). `after`: an event the copies (or,
    /// without `backup`, the unmaps) wait for. Returns the bytes released. A failure before
    /// the first unmap changes nothing; one after it keeps what was released paused (the
    /// resume maps it again) and says so.
    pub fn pause(&mut self, after: Option<EventHandle>, backup: bool, calls: &mut DriverCalls) -> Result<usize> {
        if self.paused.is_some() {
            return Err(Error::InvalidArgument("pause: this memory is paused already".into()));
        }
        let homes: Vec<(usize, usize, bool)> = self.handles.iter().map(|(&b, &(_, l))| (b, l, false)).collect();
        let total: usize = homes.iter().map(|h| h.1).sum();
        // With a backup, each run's copy is followed by an event, and each allocation is
        // released as soon as the copy of its run is done: the releases run while the
        // later copies do.
        let mut copied: Vec<(usize, sys::CUevent)> = Vec::new();
        if backup && total > 0 {
            let host = self.host_buffer(total, calls)?;
            let stream = self.copy_stream()?;
            let queued = self.queue_copies(host, stream, after, &homes, &mut copied, calls);
            if let Err(e) = queued {
                let _ = unsafe { sys::cuStreamSynchronize(stream) };
                destroy(&copied);
                return Err(e);
            }
        } else if let Some(ev) = after {
            calls.event_sync += 1;
            check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(ev as sys::CUevent) })?;
        }
        let aliases: Vec<(usize, usize, usize, bool)> = self
            .alias_maps
            .iter()
            .map(|(&a, &l)| (a, l, self.aliases.get(&a).copied().unwrap_or(a), false))
            .collect();
        let mut paused = PausedSpace { homes, aliases, backed_up: backup };
        let outcome = self.release_paused(&mut paused, &copied, calls);
        if outcome.is_err() && !copied.is_empty() {
            // The copies still queued must end before their buffer is used again.
            let _ = unsafe { sys::cuStreamSynchronize(self.copy_stream) };
        }
        destroy(&copied);
        if outcome.is_err() && !paused.homes.iter().any(|h| h.2) {
            // Nothing released yet: map the aliases unmapped so far again and refuse the
            // pause with nothing changed.
            for a in paused.aliases.iter_mut().filter(|a| a.3) {
                let Some(&(h, _)) = self.handles.get(&a.2) else { continue };
                calls.mem_map += 1;
                if unsafe { sys::cuMemMap(a.0 as sys::CUdeviceptr, a.1, 0, h, 0) } == sys::CUresult::CUDA_SUCCESS
                    && self.set_access(a.0, a.1, calls) == sys::CUresult::CUDA_SUCCESS
                {
                    a.3 = false;
                }
            }
            if !paused.aliases.iter().any(|a| a.3) {
                return outcome.map(|()| total);
            }
        }
        self.paused = Some(paused);
        outcome.map(|()| total)
    }

    /// Queue the copy of every run of `homes` to `host` on `stream` after `after`, each
    /// followed by an event recorded in `copied` with the run's end address.
    fn queue_copies(
        &mut self,
        host: *mut u8,
        stream: sys::CUstream,
        after: Option<EventHandle>,
        homes: &[(usize, usize, bool)],
        copied: &mut Vec<(usize, sys::CUevent)>,
        calls: &mut DriverCalls,
    ) -> Result<()> {
        if let Some(ev) = after {
            calls.stream_wait += 1;
            check("cuStreamWaitEvent", unsafe { sys::cuStreamWaitEvent(stream, ev as sys::CUevent, 0) })?;
        }
        for (addr, len, offset) in runs(homes, |_| true) {
            // SAFETY: `host` holds every home's bytes in order; the range is mapped memory.
            check("cuMemcpyDtoHAsync", unsafe {
                sys::cuMemcpyDtoHAsync_v2(host.add(offset).cast(), addr as sys::CUdeviceptr, len, stream)
            })?;
            let mut ev: sys::CUevent = std::ptr::null_mut();
            let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
            check("cuEventCreate", unsafe { sys::cuEventCreate(&mut ev, flags) })?;
            copied.push((addr + len, ev));
            calls.event_record += 1;
            check("cuEventRecord", unsafe { sys::cuEventRecord(ev, stream) })?;
        }
        Ok(())
    }

    /// Unmap the aliases, then unmap and release the homes (each once the copy of its run
    /// in `copied` is done), marking each done.
    fn release_paused(&mut self, p: &mut PausedSpace, copied: &[(usize, sys::CUevent)], calls: &mut DriverCalls) -> Result<()> {
        let mut run = 0;
        for a in p.aliases.iter_mut() {
            calls.mem_unmap += 1;
            check("cuMemUnmap", unsafe { sys::cuMemUnmap(a.0 as sys::CUdeviceptr, a.1) })
                .map_err(|e| midway("unmapping an alias", e))?;
            a.3 = true;
        }
        for h in p.homes.iter_mut() {
            let Some(&(handle, len)) = self.handles.get(&h.0) else { continue };
            // Its contents are in the host buffer once its run's copy is done.
            while run < copied.len() && copied[run].0 <= h.0 {
                run += 1;
            }
            if let Some(&(_, ev)) = copied.get(run) {
                calls.event_sync += 1;
                check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(ev) }).map_err(|e| midway("waiting for a copy", e))?;
            }
            calls.mem_unmap += 1;
            check("cuMemUnmap", unsafe { sys::cuMemUnmap(h.0 as sys::CUdeviceptr, len) })
                .map_err(|e| midway("unmapping an allocation", e))?;
            self.handles.remove(&h.0);
            h.2 = true;
            if let Some(fd) = self.exported.remove(&h.0) {
                // Its exports end (the pool refuses a pause while a block's export is
                // live; this one's blocks were freed): the new memory is not theirs.
                crate::share::protocol::ExportRecord::granule_released(fd, 0);
                // SAFETY: the descriptor `export` got for this allocation, ours to close.
                unsafe { libc::close(fd) };
            }
            calls.mem_release += 1;
            // The address is unmapped; a failed release leaks the memory but not the range.
            let _ = check("cuMemRelease", unsafe { sys::cuMemRelease(handle) });
        }
        Ok(())
    }

    /// Map new memory where a pause released it, at the homes and aliases, and copy the
    /// backup back. Each batch's copy is queued as soon as it is mapped, so the copies run
    /// while the next batches are created. All or nothing for the memory: a refusal
    /// (out of memory) unmaps what this call mapped and the memory stays paused, for a later
    /// resume. An alias the driver will not map again keeps the pause (its homes mapped),
    /// and the next resume tries the rest.
    pub fn resume(&mut self, calls: &mut DriverCalls) -> std::result::Result<usize, AllocError> {
        let Some(mut p) = self.paused.take() else { return Ok(0) };
        let copy = if p.backed_up {
            let host = self.backup.as_ref().map(|b| b.ptr);
            match (host, self.copy_stream()) {
                (Some(h), Ok(s)) => Some((h, s)),
                (None, _) => {
                    self.paused = Some(p);
                    return Err(AllocError::Other(Error::Internal("resume: the backup is gone".into())));
                }
                (_, Err(e)) => {
                    self.paused = Some(p);
                    return Err(AllocError::Other(e));
                }
            }
        } else {
            None
        };
        let mut made: Vec<(usize, usize)> = Vec::new();
        let mut failure: Option<AllocError> = None;
        for (base, len, piece, at) in resume_batches(&p.homes) {
            // The batch's allocations, one grant for all of them, one copy: a tag mapped
            // granule by granule costs a create and a map per granule, not a grant and a
            // copy too. All or nothing within the batch.
            if let Err(f) = self.map_pieces(base, len, piece, calls) {
                failure = Some(f);
                break;
            }
            made.extend((base..base + len).step_by(piece).map(|b| (b, piece)));
            if let Some((host, stream)) = copy {
                // SAFETY: the buffer holds every home's contents in order; the batch is
                // mapped and its homes are consecutive there.
                let r = unsafe { sys::cuMemcpyHtoDAsync_v2(base as sys::CUdeviceptr, host.add(at).cast(), len, stream) };
                if r != sys::CUresult::CUDA_SUCCESS {
                    failure = Some(AllocError::Other(cuda_error("cuMemcpyHtoDAsync", r)));
                    break;
                }
            }
        }
        if let Some((_, stream)) = copy {
            calls.event_sync += 1;
            let r = check("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(stream) });
            if let (Err(e), None) = (r, &failure) {
                failure = Some(AllocError::Other(e));
            }
        }
        if let Some(f) = failure {
            for (base, len) in made {
                if let Some((h, _)) = self.handles.remove(&base) {
                    calls.mem_unmap += 1;
                    calls.mem_release += 1;
                    unsafe {
                        sys::cuMemUnmap(base as sys::CUdeviceptr, len);
                        sys::cuMemRelease(h);
                    }
                }
            }
            self.paused = Some(p);
            return Err(f);
        }
        for h in p.homes.iter_mut() {
            h.2 = false;
        }
        for i in 0..p.aliases.len() {
            let (at, len, home, unmapped) = p.aliases[i];
            let Some(&(h, _)) = self.handles.get(&home).filter(|_| unmapped) else { continue };
            calls.mem_map += 1;
            let mapped = check("cuMemMap", unsafe { sys::cuMemMap(at as sys::CUdeviceptr, len, 0, h, 0) }).and_then(|()| {
                match self.set_access(at, len, calls) {
                    sys::CUresult::CUDA_SUCCESS => Ok(()),
                    r => Err(cuda_error("cuMemSetAccess", r)),
                }
            });
            if let Err(e) = mapped {
                self.paused = Some(p);
                return Err(AllocError::Other(midway("mapping an alias again", e)));
            }
            p.aliases[i].3 = false;
        }
        Ok(made.iter().map(|m| m.1).sum())
    }

    /// The copy stream and host buffer go with the address space.
    pub(super) fn drop_pause_resources(&mut self) {
        if let Some(p) = self.paused.as_mut() {
            p.backed_up = false;
        }
        self.drop_backup();
        if !self.copy_stream.is_null() {
            unsafe { sys::cuStreamDestroy_v2(self.copy_stream) };
            self.copy_stream = std::ptr::null_mut();
        }
    }
}

/// Destroy the copies' events (the stream is past them, or waited for).
fn destroy(events: &[(usize, sys::CUevent)]) {
    for &(_, ev) in events {
        unsafe { sys::cuEventDestroy_v2(ev) };
    }
}

fn midway(step: &str, e: Error) -> Error {
    Error::Internal(format!("{step} failed ({e}); the memory stays paused and the next resume maps the rest"))
}

#[cfg(test)]
mod tests {
    use super::{resume_batches, runs, RESUME_BATCH};

    #[test]
    fn adjacent_allocations_copy_as_one_run_with_buffer_offsets() {
        let homes = [(0x1000, 0x100, true), (0x1100, 0x100, false), (0x2000, 0x100, true)];
        assert_eq!(runs(&homes, |_| true), vec![(0x1000, 0x200, 0), (0x2000, 0x100, 0x200)]);
        assert_eq!(runs(&homes, |r| r), vec![(0x1000, 0x100, 0), (0x2000, 0x100, 0x200)]);
    }

    const G: usize = 2 << 20;

    #[test]
    fn resume_batches_join_adjacent_released_homes_of_one_size_up_to_the_batch() {
        // Granules at 0..40 (adjacent), one not released at 40, a chunk at 50, granules at 60..62.
        let mut homes: Vec<(usize, usize, bool)> = (0..40).map(|i| (i * G, G, true)).collect();
        homes.push((40 * G, G, false));
        homes.push((50 * G, 8 * G, true));
        homes.extend((58..60).map(|i| (i * G, G, true)));
        let b = resume_batches(&homes);
        let per = RESUME_BATCH / G;
        assert_eq!(b[0], (0, RESUME_BATCH, G, 0));
        assert_eq!(b[1], (per * G, (40 - per) * G, G, per * G));
        // The unreleased home breaks the run but its bytes still count in the offsets.
        assert_eq!(b[2], (50 * G, 8 * G, 8 * G, 41 * G));
        // Adjacent to the chunk but of another size: a batch of its own.
        assert_eq!(b[3], (58 * G, 2 * G, G, 49 * G));
        assert_eq!(b.len(), 4);
        let covered: usize = b.iter().map(|x| x.1).sum();
        assert_eq!(covered, homes.iter().filter(|h| h.2).map(|h| h.1).sum::<usize>());
    }
}

