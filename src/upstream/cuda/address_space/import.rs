//! Another process's allocations mapped here (`CudaVmm::import`): each listed whole,
//! granule by granule from offset 0, imported once and mapped with one `cuMemMap`.

use super::super::driver::check;
use super::{CudaVmm, POSIX_FD};
use crate::error::{Error, Result};
use crate::share::protocol::{GranuleDescriptor, FdSource};
use crate::upstream::DriverCalls;
use cudarc::driver::sys;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

/// Nanoseconds this process's imports spent in each kind of driver call, in the order of
/// `IMPORT_PHASES`, and how many imports were made or tried (`gpupool_share_ahead_json`): what a
/// receiver waits for, phase by phase. The import of a handle and the access grant cost
/// driver time for every allocation mapped, and the driver makes them one at a time for
/// the whole process (`docs/ipc.md`), so the count of allocations under what is sent is
/// what decides a receiver's cost.
pub static IMPORT_NS: [AtomicU64; 5] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];
pub static IMPORTS_MADE: AtomicU64 = AtomicU64::new(0);
pub const IMPORT_PHASES: [&str; 5] = ["reserve", "import", "map", "release", "grant"];

/// Adds the time since `*t` to phase `k` and restarts `*t`.
fn lap(k: usize, t: &mut Instant) {
    let now = Instant::now();
    IMPORT_NS[k].fetch_add(now.duration_since(*t).as_nanos() as u64, Relaxed);
    *t = now;
}

impl CudaVmm {
    /// Map the allocations of `d` (behind the descriptors `fds` yields; each listed whole,
    /// granule by granule from offset 0) side by side in a new range, readable and writable
    /// by the device and its peers; returns the block's address there. All or nothing.
    pub fn import(&mut self, d: &GranuleDescriptor, fds: &FdSource, calls: &mut DriverCalls) -> Result<usize> {
        // Exports list the device's granularity whatever the exporter's granule.
        let granule = self.device_granule;
        if d.granule != granule as u64 {
            return Err(Error::InvalidArgument(format!(
                "IPC import: the exporter's granule is {} bytes, this device's {granule}",
                d.granule
            )));
        }
        let pieces = allocations_of(d)?;
        let len = d.granules.len() * granule;
        let mut t = Instant::now();
        IMPORTS_MADE.fetch_add(1, Relaxed);
        let base = self.reserve(len, calls)?;
        lap(0, &mut t);
        let mut mapped: Vec<usize> = Vec::new();
        let result = (|| {
            let mut at = 0;
            for &(i, n) in &pieces {
                let shared = &d.granules[i];
                // A fetched descriptor closes at the end of this turn: the mapping keeps the memory.
                let (fd, _fetched) = fds.get(i, shared)?;
                let mut h: sys::CUmemGenericAllocationHandle = 0;
                calls.shareable += 1;
                check("cuMemImportFromShareableHandle", unsafe {
                    sys::cuMemImportFromShareableHandle(&mut h, fd as usize as *mut std::ffi::c_void, POSIX_FD)
                })?;
                lap(1, &mut t);
                calls.mem_map += 1;
                let r = check("cuMemMap", unsafe { sys::cuMemMap((base + at) as sys::CUdeviceptr, n * granule, 0, h, 0) });
                lap(2, &mut t);
                // The mapping keeps the memory; the handle is not needed past it.
                calls.mem_release += 1;
                unsafe { sys::cuMemRelease(h) };
                lap(3, &mut t);
                r?;
                mapped.push(n * granule);
                at += n * granule;
            }
            let granted = self.grant_import(base, len, calls);
            lap(4, &mut t);
            granted
        })();
        if let Err(e) = result {
            // A driver that fails the import and then the unmap has lost the range either
            // way: the import's error is the one returned, the lost range is said once.
            match self.unmap_imported(base, &mapped, calls) {
                Ok(()) => {
                    let _ = self.unreserve(base, len, calls);
                }
                Err((_, undo)) => crate::error::warn(&format!(
                    "IPC import failed ({e}) and undoing it failed too ({undo}): {len} bytes of address space at {base:#x} \
                     stay mapped to the exporter's memory until this process ends"
                )),
            }
            return Err(e);
        }
        let ptr = base + d.offset as usize;
        self.imports.insert(base, (len, ptr, mapped));
        Ok(ptr)
    }

    /// Grant an imported range to the device and its peers, or to the device alone where
    /// a peer is refused. Unlike `set_access` the peer list stays as it is: a refusal for
    /// another process's memory says nothing about this arena's own.
    fn grant_import(&self, base: usize, len: usize, calls: &mut DriverCalls) -> Result<()> {
        let r = self.grant(base, len, self.access.len(), calls);
        if r == sys::CUresult::CUDA_SUCCESS || self.access.len() == 1 {
            return check("cuMemSetAccess", r);
        }
        check("cuMemSetAccess", self.grant(base, len, 1, calls))
    }

    /// Unmap the range `import` returned `ptr` for and give its address space back.
    /// `Ok(false)`: `ptr` is no such address. On a driver failure the range stays
    /// recorded (and the pool busy), so nothing is forgotten while still mapped, and a
    /// retry resumes at the mapping that failed.
    pub fn unimport(&mut self, ptr: usize, calls: &mut DriverCalls) -> Result<bool> {
        // The block may start past the range's first granule (a chunk listed whole).
        let Some((base, (len, returned, maps))) = self.imports.range(..=ptr).next_back().map(|(&b, v)| (b, v.clone())) else {
            return Ok(false);
        };
        if returned != ptr {
            return Ok(false);
        }
        // Kernels this process queued on the block may still read or write it: unmapping
        // under them faults. The block's streams are not known here, so the device's work
        // is waited for (closes are rare; a failure leaves the range mapped and booked).
        calls.event_sync += 1;
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })?;
        let from = base + len - maps.iter().sum::<usize>();
        match self.unmap_imported(from, &maps, calls) {
            Ok(()) => {
                self.imports.remove(&base);
                self.unreserve(base, len, calls)?;
                Ok(true)
            }
            Err((unmapped, e)) => {
                self.imports.insert(base, (len, ptr, maps[unmapped..].to_vec()));
                Err(e)
            }
        }
    }

    pub fn imports(&self) -> usize {
        self.imports.len()
    }

    /// Address space the mapped imports hold.
    pub fn import_bytes(&self) -> usize {
        self.imports.values().map(|(len, _, _)| *len).sum()
    }

    /// Unmap the mappings of lengths `maps` laid side by side from `from` on, in order,
    /// stopping at the first the driver refuses; on failure, how many were unmapped.
    fn unmap_imported(&mut self, from: usize, maps: &[usize], calls: &mut DriverCalls) -> std::result::Result<(), (usize, Error)> {
        let mut p = from;
        for (k, &l) in maps.iter().enumerate() {
            calls.mem_unmap += 1;
            check("cuMemUnmap", unsafe { sys::cuMemUnmap(p as sys::CUdeviceptr, l) }).map_err(|e| (k, e))?;
            p += l;
        }
        Ok(())
    }
}

/// The allocations `d` lists, as (first entry, granules): each from offset 0 on, its
/// granules in order with the same descriptor and file. An entry that starts nowhere (an
/// allocation listed from its middle) is refused: the driver maps allocations whole.
pub fn allocations_of(d: &GranuleDescriptor) -> Result<Vec<(usize, usize)>> {
    let g = d.granule;
    let mut out: Vec<(usize, usize)> = Vec::new();
    for (i, e) in d.granules.iter().enumerate() {
        if let Some((first, n)) = out.last_mut() {
            let f = &d.granules[*first];
            if e.offset != 0 && e.fd == f.fd && e.file == f.file && e.offset == *n as u64 * g {
                *n += 1;
                continue;
            }
        }
        if e.offset != 0 {
            return Err(Error::InvalidArgument(format!(
                "IPC import: granule {i} is at offset {} of an allocation the descriptor does not list from its start",
                e.offset
            )));
        }
        out.push((i, 1));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::share::protocol::SharedGranule;
    use crate::share::protocol::FileId;

    fn entry(fd: i32, offset: u64, ino: u64) -> SharedGranule {
        SharedGranule { fd, offset, file: FileId { dev: 1, ino } }
    }

    fn descriptor(granules: Vec<SharedGranule>) -> GranuleDescriptor {
        GranuleDescriptor {
            kind: crate::share::protocol::KIND_CUDA,
            pid: 1,
            start_time: 0,
            record: Default::default(),
            device: 0,
            granule: 2 << 20,
            offset: 0,
            size: 1,
            origin: 0,
            handover: 0,
            flags: 0,
            granules,
        }
    }

    #[test]
    fn an_import_maps_each_listed_allocation_whole_and_refuses_one_listed_from_its_middle() {
        let g = 2u64 << 20;
        // A granule, a chunk of three, another granule.
        let d = descriptor(vec![entry(5, 0, 1), entry(6, 0, 2), entry(6, g, 2), entry(6, 2 * g, 2), entry(7, 0, 3)]);
        assert_eq!(allocations_of(&d).unwrap(), vec![(0, 1), (1, 3), (4, 1)]);
        // A chunk listed from its second granule, or with a gap, or two files under one number.
        for bad in [
            vec![entry(6, g, 2), entry(6, 2 * g, 2)],
            vec![entry(6, 0, 2), entry(6, 2 * g, 2)],
            vec![entry(6, 0, 2), entry(6, g, 9)],
        ] {
            assert!(allocations_of(&descriptor(bad)).is_err());
        }
    }
}
