//! Note [Keeping imports mapped]
//!
//! Rationale. A process that receives blocks from another (a rollout worker fed weights
//! every step, a consumer of a data loader's batches) gets the same exporter memory again
//! and again: a re-send of the same storages, or new tensors the exporter's pool placed in
//! the allocations it used last time. Mapping another process's memory costs driver calls
//! per allocation (import the shareable handle, map it, grant access, and on the way out a
//! device-wide wait, unmap and release; `docs/ipc.md` gives what they cost); a receiver
//! that unmaps everything when a message's tensors die pays all of it again for the next
//! message.
//!
//! Approach. Closing an import does not unmap it: the mapped range (a run: the whole
//! allocations under one block, side by side) stays, idle, and a later descriptor whose
//! granules lie inside a kept run, with the same file descriptors and identities, is served
//! from it with no driver call. Two facts make that safe:
//! - the descriptor's export is live: its token and granule digest are still in the
//!   exporter's record (`ExportRecord`), read with one `pread`;
//! - the memory behind the run is still what the descriptor names: the exporter counts
//!   every release of an exported granule in its record, and a run is used only while that
//!   count is the one read before it was mapped. An exporter's descriptor numbers name the
//!   same allocations until one is released (the exporter closes a granule's descriptor
//!   only after counting its release), so an unchanged count means unchanged memory.
//!
//! Implementation. The cache sits between the import entry (`imports.rs`'s `Importer`) and the
//! upstream's `vmm_import` / `vmm_unimport`, for descriptors whose file descriptors are
//! fetched from the exporter (`pidfd_getfd`), where its record can be read; descriptors
//! passed in by the caller are mapped and unmapped as before. It keeps the exporters it
//! opened (pidfd and record: one `pidfd_open` per exporter, not per block), the runs by
//! exporter and first granule, and the addresses handed out with their open counts (a
//! block opened twice through one run gets one address, closed twice; a close of an
//! address no longer open is refused, as before). Idle runs go when their
//! exporter's release count moves, it exits, or it no longer holds the record it was opened
//! with (an `exec`; checked at every import and at each close that leaves a run idle), when
//! more than `MAX_IDLE_RUNS` are kept (least recently used first), on `reclaim`
//! (`gpupool_empty_cache`), and before the pool is reconfigured. Dropping one is the
//! upstream's unimport, which waits for the device first (`CudaVmm::unimport`): that wait
//! is paid when a run goes, not on every close.
//!
//! Memory its exporter may pause (a tag's: `FLAG_PAUSABLE`) is kept idle too, with the
//! exporter told so: this process claims a keeper entry in the exporter's opens file and
//! counts its idle runs there (`protocol::Keeper`). A pause first refuses while any block is
//! open (each open counted in the opens file on its own), then releases the memory, which
//! moves the release count and so makes every kept run of that exporter stale, wakes the
//! keepers and waits for their counts to reach zero: this process's watcher
//! (`share::keepers`) drops its stale runs then, and the device gets the memory back before
//! the pause returns. Where no entry can be claimed, such a run is unmapped at its last
//! close, as the exporter cannot ask for it back. While a run is open, another block of the
//! same message whose allocations it maps is served from it (a message's tensors share a
//! tag's few allocations), each open still counted on its own, and never at an address
//! open already (each open's count goes with its own close).
//!
//! Limitations. A kept run holds the exporter's physical memory while the exporter keeps it
//! too; once the exporter releases any exported granule, every idle run of that exporter
//! is dropped at the next import or close here (not only the runs over the released
//! granule: the count says that something changed, not what). Until this process imports or
//! closes again, or empties its cache, memory the exporter released stays alive, unless this
//! process is one of the exporter's keepers, whose watcher drops them at the release. A run is
//! reused only for descriptors that lie inside it; blocks across allocations kept in
//! different runs are mapped again.

use crate::share::protocol::{Exporter, GranuleDescriptor, Keeper, SharedGranule};
use rustc_hash::FxHashMap;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Idle runs kept at most; past it the least recently used go.
pub const MAX_IDLE_RUNS: usize = 4096;

/// An exporter as the cache names it: pid and start time.
type ExporterKey = (u32, u64);

/// Which opening of an exporter a run was mapped through: an exporter that `exec`s (same pid
/// and start time, another program) or whose record changed is opened anew, and the runs of
/// the earlier opening may serve nothing more.
type Serial = u64;

/// One mapped range of another process's allocations.
struct Run {
    exporter: ExporterKey,
    serial: Serial,
    /// The exporter's address of the first granule, and the granules in order.
    origin: u64,
    granule: u64,
    granules: Vec<SharedGranule>,
    /// Where granule 0 is here.
    base: usize,
    /// The exporter's release count read before the run was mapped.
    releases: u64,
    /// Open blocks over it.
    users: usize,
    /// When it was last opened (the cache's clock).
    last_use: u64,
    /// Kept mapped once idle; otherwise unmapped when its last open closes, and shared
    /// only by blocks open at the same time.
    kept: bool,
    /// Memory its exporter may pause: each open counted in the exporter's opens file, and
    /// never served at an address open already.
    pausable: bool,
    /// Where a pausable run is kept idle: this process's keeper entry at the exporter, which
    /// counts the run while it is idle.
    keeper: Option<Arc<Keeper>>,
}

impl Run {
    /// The run went idle (`true`) or is open again: its keeper's count follows.
    fn count_idle(&self, idle: bool) {
        if let Some(k) = &self.keeper {
            k.count(idle);
        }
    }
}

impl Drop for Run {
    /// An idle kept run is counted out however it goes (dropped, or its cache dropped with
    /// its pool), so that its exporter's pause never waits for it.
    fn drop(&mut self) {
        if self.users == 0 && self.kept {
            self.count_idle(false);
        }
    }
}

/// The runs and exporters a pool keeps (module docs).
#[derive(Default)]
pub struct ImportCache {
    /// The current opening of each exporter with runs here.
    exporters: FxHashMap<ExporterKey, (Arc<Exporter>, Serial)>,
    next_serial: Serial,
    /// Run key (the address the upstream's import returned: what unmaps it) -> run.
    runs: FxHashMap<usize, Run>,
    /// (exporter, origin) -> run keys starting there, for lookups.
    by_origin: BTreeMap<(ExporterKey, u64), Vec<usize>>,
    /// Address handed out -> (run key, opens).
    open: FxHashMap<usize, (usize, usize)>,
    clock: u64,
    /// Opens served by a kept run, with no driver call.
    reuses: u64,
    /// Open imports of memory their exporter may pause, each open counted in its exporter's
    /// opens file until closed (`protocol::OpenMark`): address -> a mark per open.
    open_marks: FxHashMap<usize, Vec<crate::share::protocol::OpenMark>>,
}

impl ImportCache {
    /// Keep `mark` while the import at `ptr` is open.
    pub fn keep_open_mark(&mut self, ptr: usize, mark: crate::share::protocol::OpenMark) {
        self.open_marks.entry(ptr).or_default().push(mark);
    }

    /// One open of the import at `ptr` closed: its exporter's count drops by one.
    pub fn forget_open_mark(&mut self, ptr: usize) {
        if let Some(marks) = self.open_marks.get_mut(&ptr) {
            marks.pop();
            if marks.is_empty() {
                self.open_marks.remove(&ptr);
            }
        }
    }

    /// The open exporter of `d` and the serial of that opening, opened now where the kept
    /// one is not `d`'s, has exited, or no longer holds its record (`Exporter::same_record`):
    /// then the runs of the earlier opening are stale. A new opening is kept by `insert`.
    pub fn exporter(&mut self, d: &GranuleDescriptor) -> crate::error::Result<(Arc<Exporter>, Serial)> {
        let key = (d.pid, d.start_time);
        if let Some((e, serial)) = self.exporters.get(&key) {
            if e.is_of(d) && !e.exited() && e.same_record() {
                return Ok((e.clone(), *serial));
            }
            self.exporters.remove(&key);
        }
        // Kept only once an import through it succeeds (`insert`): an exporter whose every
        // import fails holds none of this process's descriptors (its pidfd and record).
        let e = Arc::new(Exporter::open(d)?);
        self.next_serial += 1;
        Ok((e, self.next_serial))
    }

    /// A run of the exporter's opening `serial` that maps `d` as mapped when the exporter's
    /// release count was `releases` (the count now): its address for `d`, opened once more.
    /// Mapped for memory of `d`'s kind (`pausable`: memory its exporter may pause), kept
    /// idle or open now; a pausable one not where `d`'s block address is open already (an
    /// export that ended and one that took its place: a close names an address, and each
    /// open's count in its exporter's opens file must go with its own).
    pub fn open_kept(&mut self, d: &GranuleDescriptor, releases: u64, serial: Serial, pausable: bool) -> Option<usize> {
        let ex = (d.pid, d.start_time);
        let n = d.granules.len() as u64;
        let found = self
            .by_origin
            .range((ex, 0)..=(ex, d.origin))
            .rev()
            .take(8)
            .flat_map(|(_, keys)| keys.iter().copied())
            .find(|k| {
                let r = &self.runs[k];
                let skip = (d.origin - r.origin) / r.granule;
                let at = r.base + (d.origin - r.origin) as usize + d.offset as usize;
                r.releases == releases
                    && r.pausable == pausable
                    && (r.kept || r.users > 0)
                    && !(pausable && self.open.contains_key(&at))
                    && r.serial == serial
                    && r.granule == d.granule
                    && (d.origin - r.origin) % r.granule == 0
                    && skip + n <= r.granules.len() as u64
                    && r.granules[skip as usize..(skip + n) as usize] == d.granules[..]
            })?;
        self.clock += 1;
        self.reuses += 1;
        let r = &self.runs[&found];
        let ptr = r.base + (d.origin - r.origin) as usize + d.offset as usize;
        // Two runs can map the same memory; an address opened through one stays with it.
        let e = self.open.entry(ptr).or_insert((found, 0));
        e.1 += 1;
        let r = self.runs.get_mut(&e.0).expect("open runs are kept");
        if r.users == 0 {
            r.count_idle(false);
        }
        r.users += 1;
        r.last_use = self.clock;
        Some(ptr)
    }

    /// The upstream mapped `d` at `ptr` (the block's address; its run starts at the
    /// descriptor's first granule), with the exporter's release count `releases` read
    /// before: an open run, kept idle after its last close where `kept` (a pausable one,
    /// `pausable`, kept only with a `keeper`).
    #[allow(clippy::too_many_arguments)]
    pub fn insert(&mut self, d: &GranuleDescriptor, ptr: usize, releases: u64, exporter: Arc<Exporter>, serial: Serial, pausable: bool, keeper: Option<Arc<Keeper>>) {
        let kept = !pausable || keeper.is_some();
        self.clock += 1;
        let ex = (d.pid, d.start_time);
        // The opening just used is the current one (dropping the exporter's last stale run
        // just before may have forgotten it).
        self.exporters.insert(ex, (exporter, serial));
        let run = Run {
            exporter: ex,
            serial,
            origin: d.origin,
            granule: d.granule,
            granules: d.granules.clone(),
            base: ptr - d.offset as usize,
            releases,
            users: 1,
            last_use: self.clock,
            kept,
            pausable,
            keeper: if pausable { keeper } else { None },
        };
        self.by_origin.entry((ex, d.origin)).or_default().push(ptr);
        self.runs.insert(ptr, run);
        let e = self.open.entry(ptr).or_insert((ptr, 0));
        e.1 += 1;
    }

    /// The run (its key) that a close of `ptr` leaves idle and that is not kept: it must be
    /// unmapped before that close is booked (a refused unmap leaves the open as it was).
    pub fn last_close_unmaps(&self, ptr: usize) -> Option<usize> {
        let &(key, _) = self.open.get(&ptr)?;
        let r = &self.runs[&key];
        (!r.kept && r.users == 1).then_some(key)
    }

    /// Close one open of `ptr`: `None` where the cache did not hand it out, else whether
    /// its run is idle now.
    pub fn close(&mut self, ptr: usize) -> Option<bool> {
        let (key, opens) = self.open.get_mut(&ptr)?;
        let key = *key;
        *opens -= 1;
        if *opens == 0 {
            self.open.remove(&ptr);
        }
        let r = self.runs.get_mut(&key).expect("open runs are kept");
        r.users -= 1;
        if r.users == 0 && r.kept {
            r.count_idle(true);
        }
        Some(r.users == 0)
    }

    /// The idle runs to drop now (their run keys, for the upstream's unimport): those whose
    /// exporter exited or released a granule since they were mapped, those past
    /// `MAX_IDLE_RUNS` (least recently used), or all of them (`everything`).
    pub fn stale(&mut self, everything: bool) -> Vec<usize> {
        // Per exporter: the current opening and its release count (None: exited).
        let mut now: FxHashMap<ExporterKey, (Serial, Option<u64>)> = FxHashMap::default();
        for (&key, (e, serial)) in &self.exporters {
            now.insert(key, (*serial, if e.exited() { None } else { e.releases() }));
        }
        let mut idle: Vec<(u64, usize, bool)> = self
            .runs
            .iter()
            .filter(|(_, r)| r.users == 0)
            .map(|(&k, r)| (r.last_use, k, everything || now.get(&r.exporter) != Some(&(r.serial, Some(r.releases)))))
            .collect();
        idle.sort_unstable();
        let over = idle.iter().filter(|(_, _, stale)| !stale).count().saturating_sub(MAX_IDLE_RUNS);
        let mut out: Vec<usize> = idle.iter().filter(|(_, _, stale)| *stale).map(|&(_, k, _)| k).collect();
        out.extend(idle.iter().filter(|(_, _, stale)| !stale).take(over).map(|&(_, k, _)| k));
        out
    }

    /// The upstream unmapped run `key`: forgotten, and its exporter too once it has none.
    pub fn dropped(&mut self, key: usize) {
        let Some(r) = self.runs.remove(&key) else { return };
        if let Some(keys) = self.by_origin.get_mut(&(r.exporter, r.origin)) {
            keys.retain(|&k| k != key);
            if keys.is_empty() {
                self.by_origin.remove(&(r.exporter, r.origin));
            }
        }
        if !self.runs.values().any(|o| o.exporter == r.exporter) {
            self.exporters.remove(&r.exporter);
        }
    }

    /// Whether `ptr` lies in a run mapped here: `Some(true)` where a block is open over
    /// that run, `Some(false)` where it is kept idle, `None` where no run holds it.
    pub fn covers(&self, ptr: usize) -> Option<bool> {
        self.runs.values().find(|r| ptr >= r.base && ptr < r.base + r.granules.len() * r.granule as usize).map(|r| r.users > 0)
    }

    /// Runs mapped (open or idle).
    pub fn runs(&self) -> usize {
        self.runs.len()
    }

    /// Runs kept idle.
    pub fn idle(&self) -> usize {
        self.runs.values().filter(|r| r.users == 0).count()
    }

    /// Opens served by a kept run.
    pub fn reuses(&self) -> u64 {
        self.reuses
    }

    /// Blocks open through the cache (an address opened twice counts twice).
    pub fn opens(&self) -> usize {
        self.open.values().map(|&(_, n)| n).sum()
    }
}
