//! Mapping another process's arena blocks for a device pool, and unmapping them: which
//! descriptors an import uses (the caller's, or fetched from the exporter), whether it is
//! counted open for an exporter that may pause the memory, whether a kept mapping serves it
//! (`import_cache.rs`), and what a close unmaps. A pool lends its cache of kept imports and
//! its upstream for one call (`Pool::importer` gives an `Importer`): the upstream makes the
//! driver calls, this file decides them.

use super::import_cache::ImportCache;
use super::protocol::{Exporter, FdSource, GranuleDescriptor, OpenMark, SegmentDescriptor, FLAG_PAUSABLE, KIND_CUDA};
use crate::error::{BadPointer, Error, Result};
use crate::upstream::Upstream;

/// This process's copies of the exporter's descriptors for `d`: `fds` (one per granule, or
/// each exporter number once in the order the descriptor first names it), or, with none
/// given, fetched from the exporter one at a time.
fn source<'a>(d: &'a GranuleDescriptor, fds: Option<&'a [i32]>) -> Result<FdSource<'a>> {
    Ok(match fds {
        Some(f) => match d.per_granule(f) {
            Some(given) => FdSource::Given(given),
            None => {
                return Err(Error::InvalidArgument(format!(
                    "IPC import: {} descriptors passed for a block of {} granules naming {} of the exporter's \
                     (pass one per granule, or each of the exporter's once in the order the descriptor first names it)",
                    f.len(),
                    d.granules.len(),
                    d.granules.iter().map(|g| g.fd).collect::<std::collections::HashSet<_>>().len()
                )))
            }
        },
        None => FdSource::fetch_from(d)?,
    })
}

/// The checks an import makes of `d` and the descriptors `fds` (a descriptor for each
/// granule, each the file the exporter shared), mapping nothing.
fn check(d: &GranuleDescriptor, fds: &[i32]) -> Result<()> {
    let source = source(d, Some(fds))?;
    let Some(fds) = source.given() else {
        return Err(Error::Internal("IPC check: descriptors were given, yet none are".into()));
    };
    let mut last = None;
    for (i, g) in d.granules.iter().enumerate() {
        // A chunk's granules share one descriptor: one check each.
        if last != Some((fds[i], g.fd, g.file)) {
            source.get(i, g)?;
            last = Some((fds[i], g.fd, g.file));
        }
    }
    Ok(())
}

/// A device pool's imports of other processes' memory, lent by the pool for one call
/// (`Pool::importer`): its cache of kept imports and the upstream that maps them.
pub struct Importer<'a> {
    cache: &'a mut ImportCache,
    up: &'a mut dyn Upstream,
    device: i32,
    /// The error a stopped pool's imports and checks return (`None`: the pool runs): it
    /// maps nothing more, and still unmaps.
    refusal: Option<Error>,
}

impl<'a> Importer<'a> {
    /// The imports of `device`'s pool: `cache` and `up` are its; `refusal`: what its imports
    /// return where it stopped.
    pub(crate) fn new(cache: &'a mut ImportCache, up: &'a mut dyn Upstream, device: i32, refusal: Option<Error>) -> Self {
        Importer { cache, up, device, refusal }
    }

    /// Map the block another process exported as `d` (decoded by the caller, before the
    /// pool's lock); returns where it starts here. `fds`: this process's copies of the
    /// exporter's descriptors, one per granule in the descriptor's order or each exporter
    /// number once in the order of its first appearance (`GranuleDescriptor::per_granule`);
    /// `None` fetches them from the exporter (`pidfd_getfd`), one at a time, and a block
    /// whose memory is still mapped from an earlier message is served with no driver call.
    pub fn import(&mut self, d: &GranuleDescriptor, fds: Option<&[i32]>) -> Result<usize> {
        self.import_marked(d, fds, None)
    }

    /// `import`, with the mark of an import of memory its exporter may pause where the
    /// caller has one (taken with the opens file its handover thread sent).
    pub(crate) fn import_marked(&mut self, d: &GranuleDescriptor, fds: Option<&[i32]>, mark: Option<OpenMark>) -> Result<usize> {
        self.usable(d)?;
        import(self.cache, &mut *self.up, d, fds, mark)
    }

    /// Map the segment pool's block another process exported as `d` (CUDA's own IPC);
    /// returns where it starts here.
    pub(crate) fn import_segment(&mut self, d: &SegmentDescriptor) -> Result<usize> {
        if let Some(e) = &self.refusal {
            return Err(e.clone());
        }
        self.up.cuda_ipc_open(&d.handle, d.offset as usize)
    }

    /// The checks `import` makes of `d` and the descriptors `fds` (the memory's kind, a
    /// descriptor for each granule, each the file the exporter shared), mapping nothing: for
    /// a block shown through an import already made (`gpupool_ipc_open_dlpack`).
    pub(crate) fn check(&self, d: &GranuleDescriptor, fds: &[i32]) -> Result<()> {
        self.usable(d)?;
        check(d, fds)
    }

    /// Unmap what `import` returned as `ptr` (that address exactly).
    pub fn close(&mut self, ptr: usize) -> Result<()> {
        close(self.cache, &mut *self.up, ptr, self.device)
    }

    /// Unmap the idle kept imports that may not serve again (an exporter released memory:
    /// its pause asks its keepers for it back, `keepers.rs`).
    pub(crate) fn drop_stale(&mut self) {
        drop_stale(self.cache, &mut *self.up, false);
    }

    /// Unmap every idle kept import (reclaim; the pool is about to be replaced).
    pub(crate) fn drop_all(&mut self) {
        drop_stale(self.cache, &mut *self.up, true);
    }

    /// How many blocks of other processes are mapped (open).
    pub fn open_count(&self) -> usize {
        count(self.cache, &*self.up)
    }

    /// Idle imports kept mapped for later messages (`import_cache.rs`).
    pub(crate) fn kept(&self) -> usize {
        self.cache.idle()
    }

    /// The pool runs, and `d` is of the memory its upstream maps (else: refused, saying so).
    fn usable(&self, d: &GranuleDescriptor) -> Result<()> {
        if let Some(e) = &self.refusal {
            return Err(e.clone());
        }
        let kind = self.up.vmm_share_kind();
        if d.kind != kind {
            let name = |k| if k == KIND_CUDA { "CUDA device" } else { "host-upstream" };
            return Err(Error::InvalidArgument(format!(
                "IPC import: the descriptor is of {} memory; device {}'s upstream ({}) maps {}",
                name(d.kind),
                self.device,
                self.up.name(),
                if kind == 0 { "none" } else { name(kind) }
            )));
        }
        Ok(())
    }
}

/// Map `d` through `up`; returns where the block starts here. `fds` given: mapped as they
/// are, counted open at the exporter (by `mark`, or by pid) where it may pause the memory.
/// None: the descriptors are fetched, and the cache of kept imports may serve the block
/// with no driver call.
fn import(cache: &mut ImportCache, up: &mut dyn Upstream, d: &GranuleDescriptor, fds: Option<&[i32]>, mark: Option<OpenMark>) -> Result<usize> {
    if fds.is_some() {
        let source = source(d, fds)?;
        // Memory its exporter may pause: counted as open there before it is mapped
        // (`protocol::opens_file`), by pid where the caller brought no mark. Where the
        // exporter's files may not be fetched (a container) and no mark came, the import
        // is not counted (docs/tags.md).
        let mark = match mark {
            Some(m) => Some(m),
            None if d.flags & FLAG_PAUSABLE != 0 => match Exporter::open(d) {
                // Counted, then checked: the export is still live (a pause in between
                // ended it, and the descriptors passed in name released memory).
                Ok(e) => match e.mark_open(d.record) {
                    Ok(m) => {
                        e.still_exports(d.record, &d.granules)?;
                        Some(m)
                    }
                    Err(err) if err.to_string().contains(OpenMark::PAUSING) => return Err(err),
                    Err(_) => None,
                },
                Err(_) => None,
            },
            None => None,
        };
        let ptr = up.vmm_import(d, &source)?;
        if let Some(m) = mark {
            cache.keep_open_mark(ptr, m);
        }
        return Ok(ptr);
    }
    let (exporter, serial) = cache.exporter(d)?;
    let source = FdSource::fetch_via(exporter.clone(), d)?;
    // Memory its exporter may pause: counted as open in the exporter's opens file from
    // before it is mapped until its close, so that a pause refuses while this process has
    // it open (and this import is refused while the exporter pauses); once idle, kept mapped
    // only where this process is one of the exporter's keepers, whose pause then asks for
    // it back (Note [Keeping imports mapped]); blocks open at the same time over the same
    // allocations share one mapping (a message's tensors).
    let pausable = d.flags & FLAG_PAUSABLE != 0;
    let mark = if pausable {
        // Counted, then checked: the export is still live (one that ended before the count
        // would not be seen by its exporter's pause, and an open run may serve it without
        // a fetch that checks again).
        let m = exporter.mark_open(d.record)?;
        exporter.still_exports(d.record, &d.granules)?;
        Some(m)
    } else {
        None
    };
    // Read before anything is mapped: a release after it moves the count past what the
    // run records, and the run is not trusted again.
    let releases = exporter
        .releases()
        .ok_or_else(|| Error::InvalidArgument(format!("IPC import: the export record of process {} cannot be read", d.pid)))?;
    drop_stale(cache, up, false);
    let ptr = match cache.open_kept(d, releases, serial, pausable) {
        Some(ptr) => ptr,
        None => {
            let ptr = up.vmm_import(d, &source)?;
            let keeper = if pausable { exporter.keeper() } else { None };
            cache.insert(d, ptr, releases, exporter, serial, pausable, keeper);
            ptr
        }
    };
    if let Some(m) = mark {
        cache.keep_open_mark(ptr, m);
    }
    Ok(ptr)
}

/// Unmap the idle kept imports that may not serve again (their exporter released memory
/// or exited, or too many are kept), or all of them (`everything`). A run the upstream
/// fails to unmap stays kept, to be tried again.
fn drop_stale(cache: &mut ImportCache, up: &mut dyn Upstream, everything: bool) {
    for key in cache.stale(everything) {
        match up.vmm_unimport(key) {
            Ok(_) => cache.dropped(key),
            Err(e) => crate::error::warn(&format!("dropping a kept import at {key:#x} failed: {e}; it stays mapped")),
        }
    }
}

/// Unmap what an import on `device` returned as `ptr` (that address exactly): an arena
/// block's (kept for the exporter's next message where it may serve again), or a segment's
/// (CUDA's own IPC).
fn close(cache: &mut ImportCache, up: &mut dyn Upstream, ptr: usize, device: i32) -> Result<()> {
    if let Some(key) = cache.last_close_unmaps(ptr) {
        // Memory its exporter may pause, kept by no keeper entry: unmapped at its last
        // close, before that close is booked and its count drops. Refused, the block stays
        // open (and counted): the caller may close it again.
        up.vmm_unimport(key)?;
        cache.close(ptr);
        cache.dropped(key);
        cache.forget_open_mark(ptr);
        return Ok(());
    }
    if let Some(idle) = cache.close(ptr) {
        cache.forget_open_mark(ptr);
        if idle {
            // Kept mapped for the exporter's next message; what may not serve again goes.
            drop_stale(cache, up, false);
        }
        return Ok(());
    }
    if let Some(open) = cache.covers(ptr) {
        // An address in a run the cache keeps, which no open block starts at: inside an
        // open block, or a block closed already. The upstream must not unmap it behind the
        // cache's books.
        let why = if open {
            "IPC close: the address lies inside another process's memory open here, not at a block's start; pass the \
             address gpupool_ipc_open returned"
        } else {
            "IPC close: the block at this address was closed already"
        };
        return Err(Error::InvalidPointer { ptr, device, why: BadPointer::Refused(why.into()) });
    }
    if up.vmm_unimport(ptr)? {
        cache.forget_open_mark(ptr);
        return Ok(());
    }
    if up.cuda_ipc_close(ptr)? {
        return Ok(());
    }
    let why = BadPointer::Refused("IPC close: not an address gpupool_ipc_open returned on this device".into());
    Err(Error::InvalidPointer { ptr, device, why })
}

/// How many blocks of other processes are mapped through `up` and `cache`.
pub(crate) fn count(cache: &ImportCache, up: &dyn Upstream) -> usize {
    // The upstream's imports count the cache's runs, which count once per open block.
    (up.vmm_imports() + cache.opens() + up.cuda_ipc_imports()).saturating_sub(cache.runs())
}
