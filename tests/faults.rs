//! Faults: an upstream that fails driver calls on a schedule (every Nth call of a kind, or
//! a seeded random one), under every strategy. Every failure must come back as a clear
//! error, the pool's books must stay exact (its invariant scan runs after every operation),
//! no block may be handed out twice or lost, and once the faults stop everything works and
//! all memory goes back. The arena's virtual memory calls fail at random points inside them
//! (a granule's creation, map or access grant, an alias's map or grant, an unmap, a release
//! after a successful unmap, an alias's removal, the export of a granule's shareable handle,
//! an import's reservation, descriptor, map or access grant, an import's unmap), and after
//! every operation its books must agree with what the host upstream really maps: nothing
//! handed out unmapped, nothing mapped over memory still mapped, no reserved range but the
//! arena's and the imports' open now, and an export that failed leaves the arena's books as
//! they were. The segment pools (`split`, `binned`, `none`) run page-mapped too, where the
//! upstream's page commit fails as a whole and its page decommit fails at any page (its
//! unmap, or the release of its memory after the unmap), and after every operation their
//! books agree with what the host really backs: the bytes held, and no block handed out
//! over a decommitted page. Also: a panic inside a pool stops that pool instead of letting
//! it hand out memory from half-updated books.

#[macro_use]
mod common;

use common::{intact, stamp, MIB};

fn check(a: usize, n: usize, id: u64) {
    assert!(intact(a, n, id), "block {a:#x}+{n} was written by someone else");
}
use gpupool::config::PoolKind;
use gpupool::error::{Error, Result};
use gpupool::stream::StreamHandle;
use gpupool::upstream::host::HostUpstream;
use gpupool::upstream::host::HOST_PAGE;
use gpupool::upstream::shared::{Descriptor, FdSource, SharedGranule};
use gpupool::upstream::{AliasFail, AllocError, EventHandle, UnmapFail, Upstream};
use std::collections::{BTreeMap, HashSet};
use gpupool::{Pool, PoolOptions};
use std::sync::{Arc, Mutex};

/// Which calls fail: each kind fails every `every`-th call when set, and every call fails
/// with probability `1/random` from the seeded generator when set (`only`: only the calls
/// of those kinds, by the names `fail` and `fail_vmm` give them, e.g. `VMM_CALLS`; at step
/// `at` where set). Also what the host really maps, kept after every such call.
#[derive(Default)]
struct Schedule {
    every: u64,
    random: u64,
    rng: u64,
    calls: u64,
    injected: u64,
    off: bool,
    only: &'static [&'static str],
    at: Option<usize>,
    /// Granules that show memory now (homes and aliases), and the bytes of the homes: what
    /// the arena's books must agree with.
    real: HashSet<usize>,
    real_home_bytes: usize,
    /// Address ranges the host has reserved (count, bytes), and the imports it maps.
    reserved: (usize, usize),
    imports: usize,
    /// Maps the pool asked for over memory still mapped, and failed imports that left
    /// memory mapped (must never happen).
    violations: Vec<String>,
    /// Granules (pages) unmapped whose release was made to fail (their memory "leaked").
    leaks: u64,
    /// Failures injected into the virtual memory calls, by call and step.
    hits: BTreeMap<&'static str, u64>,
    /// Granules of the block being exported asked for so far (the pool exports a block's
    /// granules in order, first to last).
    export_step: usize,
    /// Page-mapped: the upstream has pages (`page_size`), which segment pools decommit.
    pages: bool,
    /// Pages the host has decommitted now (inaccessible), and the bytes it backs: what a
    /// segment pool's books must agree with.
    decommitted: HashSet<usize>,
    held: usize,
}

impl Schedule {
    fn dice(&mut self) -> u64 {
        // xorshift64*: a fixed seed gives a reproducible schedule.
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn fail_any(&mut self) -> bool {
        if self.off {
            return false;
        }
        self.calls += 1;
        let by_count = self.every != 0 && self.calls % self.every == 0;
        let by_dice = self.random != 0 && self.dice() % self.random == 0;
        let f = by_count || by_dice;
        self.injected += f as u64;
        f
    }

    /// Whether this call of `kind` fails.
    fn fail(&mut self, kind: &'static str) -> bool {
        (self.only.is_empty() || self.only.contains(&kind)) && self.fail_any()
    }

    /// A position in `0..n`, where a failing call fails.
    fn position(&mut self, n: usize) -> usize {
        match self.at {
            Some(k) => k.min(n.max(1) - 1),
            None => (self.dice() % n.max(1) as u64) as usize,
        }
    }
}

/// The arena's virtual memory calls, by the names `fail_vmm` gives them.
const VMM_CALLS: &[&str] = &["map", "map chunk", "unmap", "alias", "unalias", "export", "import", "close"];

/// Every step of every virtual memory call at which a failure is injected (`Schedule::hits`);
/// the long run fails unless each was hit.
const STEPS: &[&str] = &[
    "map: create (first granule)",
    "map: create (later granule)",
    "map: map (first granule)",
    "map: map (later granule)",
    "map: set_access",
    "unmap: unmap",
    "unmap: release",
    "alias: map (first)",
    "alias: map (later)",
    "alias: set_access",
    "unalias",
    "export (first granule)",
    "export (later granule)",
    "import: reserve",
    "import: descriptor (first granule)",
    "import: descriptor (later granule)",
    "import: map (first granule)",
    "import: map (later granule)",
    "import: set_access",
    "import: close",
];

/// Every step of the page calls at which a failure is injected; the page churns fail unless
/// each was hit.
const PAGE_STEPS: &[&str] = &[
    "commit",
    "decommit: unmap (first page)",
    "decommit: unmap (later page)",
    "decommit: release (first page)",
    "decommit: release (later page)",
];

fn first_or_later(k: usize, first: &'static str, later: &'static str) -> &'static str {
    if k == 0 {
        first
    } else {
        later
    }
}

/// The schedule, also after a failed assertion poisoned its lock (the pool's teardown still
/// calls the upstream, and a second panic would abort the test run).
fn lock(s: &Mutex<Schedule>) -> std::sync::MutexGuard<'_, Schedule> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}

struct FaultyUpstream {
    host: HostUpstream,
    s: Arc<Mutex<Schedule>>,
    next_event: usize,
}

fn injected(what: &str) -> Error {
    Error::Cuda { call: "injected", code: 999, name: what.to_string() }
}

/// Bytes of this process's mappings of the file with inode `ino` (`/proc/self/maps`).
fn mapped_of_file(ino: u64) -> usize {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() >= 5 && f[4].parse::<u64>().ok() == Some(ino)).then_some(f[0])
        })
        .map(|range| {
            let (a, b) = range.split_once('-').unwrap();
            usize::from_str_radix(b, 16).unwrap() - usize::from_str_radix(a, 16).unwrap()
        })
        .sum()
}

/// A live descriptor of another file (a pipe's read end; its write end is closed): what a
/// stale descriptor number names.
fn another_file() -> i32 {
    let mut p = [0i32; 2];
    assert_eq!(unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    unsafe { libc::close(p[1]) };
    p[0]
}

/// The file of `fd` opened again write-only: the same file (it passes the identity check),
/// which `mmap` refuses to map readable.
fn write_only(fd: i32) -> i32 {
    let path = std::ffi::CString::new(format!("/proc/self/fd/{fd}")).unwrap();
    let w = unsafe { libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC) };
    assert!(w >= 0, "reopening descriptor {fd}: {}", std::io::Error::last_os_error());
    w
}

impl FaultyUpstream {
    fn fail(&self, kind: &'static str) -> bool {
        lock(&self.s).fail(kind)
    }

    /// Whether this call of `kind` (a VMM or page call) fails, and if so where in its `n`
    /// steps.
    fn fail_vmm(&self, kind: &'static str, n: usize) -> Option<usize> {
        let mut s = lock(&self.s);
        s.fail(kind).then(|| s.position(n))
    }

    fn hit(&self, step: &'static str) {
        *lock(&self.s).hits.entry(step).or_default() += 1;
    }

    /// Note what the host really maps in `[addr, addr + len)` after a VMM call.
    fn sync(&self, addr: usize, len: usize) {
        let mut s = lock(&self.s);
        for g in (addr..addr + len).step_by(HOST_PAGE) {
            if self.host.vmm_is_mapped(g) {
                s.real.insert(g);
            } else {
                s.real.remove(&g);
            }
        }
        s.real_home_bytes = self.host.vmm_mapped_bytes();
        s.reserved = self.host.vmm_reserved();
        s.imports = self.host.vmm_imports();
    }

    /// Note which pages of `[addr, addr + len)` the host has decommitted, and the bytes it
    /// backs, after a call that may change them.
    fn sync_pages(&self, addr: usize, len: usize) {
        let mut s = lock(&self.s);
        if !s.pages {
            return;
        }
        for p in (addr & !(HOST_PAGE - 1)..addr + len).step_by(HOST_PAGE) {
            if self.host.is_decommitted(p) {
                s.decommitted.insert(p);
            } else {
                s.decommitted.remove(&p);
            }
        }
        s.held = self.host.held_bytes();
    }

    /// The pool must never map over memory still mapped: the driver would refuse, and books
    /// that allow it are wrong.
    fn expect_unmapped(&self, addr: usize, len: usize, what: &str) {
        let mut s = lock(&self.s);
        if let Some(g) = (addr..addr + len).step_by(HOST_PAGE).find(|g| s.real.contains(g)) {
            s.violations.push(format!("{what} over {g:#x}, which is mapped"));
        }
    }

    /// Import `d` with granule `i`'s descriptor replaced by `fd` (the host's import fails
    /// there and undoes what it did).
    fn import_with(&mut self, d: &Descriptor, fds: &FdSource, i: usize, fd: i32) -> Result<usize> {
        let FdSource::Given(given) = fds else { return Err(injected("import (descriptors fetched)")) };
        let mut mine = given.to_vec();
        mine[i] = fd;
        let r = self.host.vmm_import(d, &FdSource::Given(&mine));
        unsafe { libc::close(fd) };
        r
    }
}

impl Upstream for FaultyUpstream {
    fn name(&self) -> &'static str {
        "faulty-host"
    }
    fn allocate(&mut self, size: usize, st: StreamHandle) -> std::result::Result<usize, AllocError> {
        if self.fail("allocate") {
            // Half the failures look like out of memory (the pool escalates), half like a
            // broken driver (reported as is).
            return Err(if size % 2 == 0 { AllocError::OutOfMemory } else { AllocError::Other(injected("allocate")) });
        }
        let r = self.host.allocate(size, st);
        self.sync_pages(0, 0);
        r
    }
    fn deallocate(&mut self, a: usize, size: usize, st: StreamHandle) -> Result<()> {
        if self.fail("deallocate") {
            return Err(injected("deallocate"));
        }
        let r = self.host.deallocate(a, size, st);
        self.sync_pages(a, size);
        r
    }
    fn page_size(&self) -> usize {
        if lock(&self.s).pages {
            self.host.page_size()
        } else {
            0
        }
    }
    fn commit(&mut self, addr: usize, len: usize) -> std::result::Result<(), AllocError> {
        // The pool recommits only pages it decommitted, which the host must have decommitted.
        if let Some(p) = (addr..addr + len).step_by(HOST_PAGE).find(|p| !self.host.is_decommitted(*p)) {
            lock(&self.s).violations.push(format!("commit over {p:#x}, which is backed"));
        }
        // The commit fails as a whole (out of memory, or a broken driver): nothing is backed.
        if let Some(k) = self.fail_vmm("commit", 2) {
            self.hit("commit");
            return Err(if k == 0 { AllocError::OutOfMemory } else { AllocError::Other(injected("commit")) });
        }
        let r = self.host.commit(addr, len);
        self.sync_pages(addr, len);
        r
    }
    fn decommit(&mut self, addr: usize, len: usize) -> std::result::Result<(), UnmapFail> {
        if let Some(p) = (addr..addr + len).step_by(HOST_PAGE).find(|p| self.host.is_decommitted(*p)) {
            lock(&self.s).violations.push(format!("decommit over {p:#x}, which is decommitted"));
        }
        let n = len / HOST_PAGE;
        // Page k's unmap fails (it and the pages after it stay backed), or its unmap
        // succeeds and the release of its memory fails (it is gone, its memory leaked); the
        // pages before it are gone.
        let r = match self.fail_vmm("decommit", 2 * n) {
            None => self.host.decommit(addr, len),
            Some(k) => {
                let (page, release) = (k / 2, k % 2 == 1);
                self.hit(match (release, page) {
                    (false, 0) => "decommit: unmap (first page)",
                    (false, _) => "decommit: unmap (later page)",
                    (true, 0) => "decommit: release (first page)",
                    (true, _) => "decommit: release (later page)",
                });
                let gone = (page + release as usize) * HOST_PAGE;
                match self.host.decommit(addr, gone) {
                    Err(f) => Err(f),
                    Ok(()) if release => {
                        lock(&self.s).leaks += 1;
                        Err(UnmapFail { unmapped: gone, leaked: HOST_PAGE, error: injected("decommit release") })
                    }
                    Ok(()) => Err(UnmapFail { unmapped: gone, leaked: 0, error: injected("decommit unmap") }),
                }
            }
        };
        self.sync_pages(addr, len);
        r
    }
    fn mem_info(&mut self) -> Result<(usize, usize)> {
        self.host.mem_info()
    }
    fn event_create(&mut self) -> Result<EventHandle> {
        if self.fail("event create") {
            return Err(injected("event create"));
        }
        self.next_event += 1;
        Ok(self.next_event)
    }
    fn event_record(&mut self, _ev: EventHandle, _s: StreamHandle) -> Result<()> {
        if self.fail("event record") {
            return Err(injected("event record"));
        }
        Ok(())
    }
    fn event_query(&mut self, _ev: EventHandle) -> Result<bool> {
        if self.fail("event query") {
            return Err(injected("event query"));
        }
        // Busy while faults are injected (cross-stream reuse must wait), idle after.
        Ok(lock(&self.s).off)
    }
    fn event_synchronize(&mut self, _ev: EventHandle) -> Result<()> {
        if self.fail("event synchronize") {
            return Err(injected("event synchronize"));
        }
        Ok(())
    }
    fn stream_wait_event(&mut self, _s: StreamHandle, _ev: EventHandle) -> Result<()> {
        if self.fail("stream wait") {
            return Err(injected("stream wait"));
        }
        Ok(())
    }
    fn synchronize_device(&mut self) -> Result<()> {
        if self.fail("device synchronize") {
            return Err(injected("device synchronize"));
        }
        Ok(())
    }
    fn vmm_granule(&mut self) -> usize {
        self.host.vmm_granule()
    }
    fn vmm_reserve(&mut self, len: usize) -> Result<usize> {
        let r = self.host.vmm_reserve(len);
        self.sync(0, 0);
        r
    }
    fn vmm_unreserve(&mut self, base: usize, len: usize) -> Result<()> {
        let r = self.host.vmm_unreserve(base, len);
        self.sync(0, 0);
        r
    }
    fn vmm_map_new(&mut self, addr: usize, len: usize) -> std::result::Result<(), AllocError> {
        self.expect_unmapped(addr, len, "map");
        let n = len / HOST_PAGE;
        // Granule k's creation (an even k: out of memory), its map, or the access grant
        // over all of them (k = n) fails; the upstream undoes what it mapped (all or nothing).
        if let Some(k) = self.fail_vmm("map", 2 * n + 1) {
            if k / 2 > 0 && self.host.vmm_map_new(addr, k / 2 * HOST_PAGE).is_ok() {
                let _ = self.host.vmm_unmap(addr, k / 2 * HOST_PAGE);
            }
            return Err(match k {
                k if k == 2 * n => {
                    self.hit("map: set_access");
                    AllocError::Other(injected("set access"))
                }
                k if k % 2 == 0 => {
                    self.hit(first_or_later(k / 2, "map: create (first granule)", "map: create (later granule)"));
                    AllocError::OutOfMemory
                }
                _ => {
                    self.hit(first_or_later(k / 2, "map: map (first granule)", "map: map (later granule)"));
                    AllocError::Other(injected("map"))
                }
            });
        }
        let r = self.host.vmm_map_new(addr, len);
        self.sync(addr, len);
        r
    }
    fn vmm_map_chunk(&mut self, addr: usize, len: usize) -> std::result::Result<(), AllocError> {
        self.expect_unmapped(addr, len, "map chunk");
        // One allocation: its creation (out of memory), its map, or the access grant fails,
        // and nothing stays mapped.
        if let Some(k) = self.fail_vmm("map chunk", 3) {
            self.hit(["map chunk: create", "map chunk: map", "map chunk: set_access"][k]);
            return Err(if k == 0 { AllocError::OutOfMemory } else { AllocError::Other(injected("map chunk")) });
        }
        let r = self.host.vmm_map_chunk(addr, len);
        self.sync(addr, len);
        r
    }
    fn vmm_unmap(&mut self, addr: usize, len: usize) -> std::result::Result<(), UnmapFail> {
        let n = len / HOST_PAGE;
        // Granule k's unmap fails (it stays mapped), or its unmap succeeds and the release
        // of its memory fails (its address is gone, its memory leaked); the ones before it
        // are gone.
        let r = match self.fail_vmm("unmap", 2 * n) {
            None => self.host.vmm_unmap(addr, len),
            Some(k) => {
                self.hit(if k % 2 == 0 { "unmap: unmap" } else { "unmap: release" });
                let before = k / 2 * HOST_PAGE;
                match self.host.vmm_unmap(addr, before) {
                    Err(f) => Err(f),
                    Ok(()) if k % 2 == 0 => Err(UnmapFail { unmapped: before, leaked: 0, error: injected("unmap") }),
                    Ok(()) => match self.host.vmm_unmap(addr + before, HOST_PAGE) {
                        Err(f) => Err(UnmapFail { unmapped: before + f.unmapped, ..f }),
                        Ok(()) => {
                            lock(&self.s).leaks += 1;
                            Err(UnmapFail { unmapped: before + HOST_PAGE, leaked: HOST_PAGE, error: injected("release") })
                        }
                    },
                }
            }
        };
        self.sync(addr, len);
        r
    }
    fn vmm_alias(&mut self, homes: &[usize], to: usize) -> std::result::Result<(), AliasFail> {
        self.expect_unmapped(to, homes.len() * HOST_PAGE, "alias");
        // The map of alias `made` fails, or (made = all) the access grant over them, which
        // leaves them all in place.
        let r = match self.fail_vmm("alias", homes.len() + 1) {
            None => self.host.vmm_alias(homes, to),
            Some(made) => {
                self.hit(match made {
                    m if m == homes.len() => "alias: set_access",
                    0 => "alias: map (first)",
                    _ => "alias: map (later)",
                });
                match self.host.vmm_alias(&homes[..made], to) {
                    Err(f) => Err(f),
                    Ok(()) => Err(AliasFail { made, error: injected(if made == homes.len() { "alias access" } else { "alias" }) }),
                }
            }
        };
        self.sync(to, homes.len() * HOST_PAGE);
        r
    }
    fn vmm_unalias(&mut self, addr: usize, len: usize) -> Result<()> {
        if self.fail_vmm("unalias", 1).is_some() {
            self.hit("unalias");
            return Err(injected("unalias"));
        }
        let r = self.host.vmm_unalias(addr, len);
        self.sync(addr, len);
        r
    }
    fn vmm_share_kind(&self) -> u32 {
        self.host.vmm_share_kind()
    }
    fn vmm_export(&mut self, addr: usize) -> Result<SharedGranule> {
        let step = {
            let mut s = lock(&self.s);
            s.export_step += 1;
            s.export_step - 1
        };
        // The shareable handle of the block's `step`-th granule is refused.
        if self.fail_vmm("export", 1).is_some() {
            self.hit(first_or_later(step, "export (first granule)", "export (later granule)"));
            return Err(injected("export"));
        }
        self.host.vmm_export(addr)
    }
    fn vmm_import(&mut self, d: &Descriptor, fds: &FdSource) -> Result<usize> {
        let n = d.granules.len();
        let file = d.granules[0].file.ino;
        let before = mapped_of_file(file);
        // The reservation fails (k = 0), granule i's descriptor names another file
        // (k = 1 + i) or cannot be mapped (k = 1 + n + i), or the access grant over the
        // whole range fails (k = 1 + 2n). The host's import undoes what it did on the
        // first two; the grant's failure is undone here, as the driver's upstream does.
        let r = match self.fail_vmm("import", 2 * n + 2) {
            None => self.host.vmm_import(d, fds),
            Some(0) => {
                self.hit("import: reserve");
                Err(injected("import reserve"))
            }
            Some(k) if k <= n => {
                self.hit(first_or_later(k - 1, "import: descriptor (first granule)", "import: descriptor (later granule)"));
                self.import_with(d, fds, k - 1, another_file())
            }
            Some(k) if k <= 2 * n => {
                self.hit(first_or_later(k - 1 - n, "import: map (first granule)", "import: map (later granule)"));
                let FdSource::Given(given) = fds else { return Err(injected("import (descriptors fetched)")) };
                let w = write_only(given[k - 1 - n]);
                self.import_with(d, fds, k - 1 - n, w)
            }
            Some(_) => {
                self.hit("import: set_access");
                self.host.vmm_import(d, fds).and_then(|p| {
                    assert!(self.host.vmm_unimport(p).unwrap(), "the range just imported closes");
                    Err(injected("import set access"))
                })
            }
        };
        if r.is_err() {
            let after = mapped_of_file(file);
            if after != before {
                lock(&self.s).violations.push(format!("a failed import left {} bytes of the exporter's file mapped", after.abs_diff(before)));
            }
        }
        self.sync(0, 0);
        r
    }
    fn vmm_unimport(&mut self, ptr: usize) -> Result<bool> {
        // A close the driver fails leaves the range mapped and booked, for a retry.
        if self.fail_vmm("close", 1).is_some() {
            self.hit("import: close");
            return Err(injected("import close"));
        }
        let r = self.host.vmm_unimport(ptr);
        self.sync(0, 0);
        r
    }
    fn vmm_imports(&self) -> usize {
        self.host.vmm_imports()
    }
}

const STREAMS: [StreamHandle; 3] = [0, 0xA00, 0xB00];

/// Imports open in a churn: (imported address, size, the exported block, its stamp id).
type Imports = Vec<(usize, usize, usize, u64)>;

/// The address range an import of a block of `n` bytes at `q` holds: its whole granules.
fn import_range(q: usize, n: usize) -> usize {
    (q + n).div_ceil(HOST_PAGE) * HOST_PAGE - (q & !(HOST_PAGE - 1))
}

/// The arena's books against what the host really maps (after operation `i`): the same
/// bytes of memory mapped, the pool never asked to map over mapped memory, no failed import
/// left memory mapped, and the host reserves the arena's ranges and the open imports'
/// alone (a failed import leaves no range behind).
fn books_agree(p: &Pool, s: &Mutex<Schedule>, i: usize, imports: &Imports) {
    let s = lock(s);
    assert!(s.violations.is_empty(), "operation {i}: {:?}", s.violations);
    let f = p.arena_figures().expect("an arena pool");
    assert_eq!(f.mapped, s.real_home_bytes, "operation {i}: the arena books {} bytes mapped, the host maps {}", f.mapped, s.real_home_bytes);
    assert_eq!(s.imports, imports.len(), "operation {i}: the host maps {} imports, {} are open", s.imports, imports.len());
    assert_eq!(p.ipc_imports(), imports.len(), "operation {i}: the pool counts {} imports", p.ipc_imports());
    let want = (3 + imports.len(), f.address_space + imports.iter().map(|&(q, n, ..)| import_range(q, n)).sum::<usize>());
    assert_eq!(s.reserved, want, "operation {i}: the host reserves (ranges, bytes) {:?}, the arena and the open imports {want:?}", s.reserved);
}

/// A segment pool's books against what the host really backs (at `at`): the
/// pool holds exactly the bytes the host backs (its segments less the pages booked
/// decommitted; a page decommitted but booked backed, or booked decommitted but backed,
/// shows here), and it never asked to commit a backed page or decommit a decommitted one.
fn pages_agree(p: &Pool, s: &Mutex<Schedule>, kind: PoolKind, at: &str) {
    let s = lock(s);
    assert!(s.violations.is_empty(), "{kind:?}, {at}: {:?}", s.violations);
    assert_eq!(
        p.reserved_bytes(),
        s.held,
        "{kind:?}, {at}: the pool books {} bytes backed, the host backs {} ({} pages decommitted)",
        p.reserved_bytes(),
        s.held,
        s.decommitted.len()
    );
}

/// Write into every page (`HOST_PAGE`, the unit of commit and decommit) the block
/// `[a, a + n)` overlaps: one with no memory behind it (`PROT_NONE`) faults.
fn touch_pages(a: usize, n: usize) {
    let pages = (a & !(HOST_PAGE - 1)..a + n).step_by(HOST_PAGE);
    for q in pages.map(|p| p.max(a)) {
        // SAFETY: a block the pool handed out on the host upstream; its stamp comes after.
        unsafe { std::ptr::write_volatile(q as *mut u8, 0x5a) };
    }
}

/// What a failed export must leave as it was: the arena's mapped, used and free bytes of
/// each range, its stitches, and the pool's cached and used bytes.
fn arena_state(p: &Pool) -> (usize, (usize, usize), (usize, usize), usize, usize, usize) {
    let f = p.arena_figures().expect("an arena pool");
    (f.mapped, f.small, f.large, f.stitches, p.cached_bytes(), p.used_bytes())
}

/// Export the live block at `a` (`n` bytes, stamped `id`) and import the descriptor
/// (its own descriptors passed in, as received over a socket). A failed export leaves the
/// arena's books as they were and the block intact; an import shows the block's bytes.
fn export_and_import(p: &mut Pool, s: &Mutex<Schedule>, (a, n, id): (usize, usize, u64), imports: &mut Imports, i: usize) {
    let before = arena_state(p);
    let injected_before = {
        let mut g = lock(s);
        g.export_step = 0;
        g.injected
    };
    match p.ipc_export(a, false) {
        Ok(bytes) => {
            let d = Descriptor::decode(&bytes).unwrap_or_else(|e| panic!("operation {i}: the descriptor exported does not decode: {e}"));
            let fds: Vec<i32> = d.granules.iter().map(|g| g.fd).collect();
            let injected_before = lock(s).injected;
            match p.ipc_import(&d, Some(&fds)) {
                Ok(q) => {
                    assert!(intact(q, n, id), "operation {i}: the import of {a:#x} at {q:#x} does not show its bytes");
                    imports.push((q, n, a, id));
                }
                Err(e) => assert!(lock(s).injected > injected_before, "operation {i}: an import failed with no fault injected: {e}"),
            }
        }
        Err(Error::Cuda { call: "injected", .. }) => {
            assert_eq!(arena_state(p), before, "operation {i}: an export that failed changed the arena's books");
            check(a, n, id);
        }
        // Refused: the block shares a granule with another live block.
        Err(Error::InvalidPointer { .. }) => {}
        Err(e) => panic!("operation {i}: export of {a:#x}: unexpected error {e} ({} faults injected before)", injected_before),
    }
}

/// Close the import at `imports[j]`; a close that fails leaves it open and mapped (`false`).
fn close_import(p: &mut Pool, imports: &mut Imports, j: usize) -> bool {
    let (q, n, _, id) = imports[j];
    check(q, n, id);
    match p.ipc_close(q) {
        Ok(()) => {
            imports.swap_remove(j);
            true
        }
        Err(Error::Cuda { call: "injected", .. }) => false,
        Err(e) => panic!("close of the import at {q:#x}: unexpected error {e}"),
    }
}

/// What a churn did: faults injected, the virtual memory and page call failures by step,
/// and the page runs the pool committed and decommitted.
struct Churned {
    faults: u64,
    hits: BTreeMap<&'static str, u64>,
    page_ops: (u64, u64),
}

/// Random operations under `schedule` (`only`: only the calls of those kinds fail). On the
/// arena some operations export a live block and import it again, or close an import.
/// `pages`: the upstream is page-mapped, so segment pools decommit the pages inside free
/// blocks and commit them again, and cache decay is on.
fn churn(kind: PoolKind, every: u64, random: u64, seed: u64, ops: usize, only: &'static [&'static str], pages: bool) -> Churned {
    let s = Arc::new(Mutex::new(Schedule { every, random, rng: seed | 1, only, pages, ..Default::default() }));
    let up = FaultyUpstream { host: HostUpstream::new(256 * MIB), s: s.clone(), next_event: 0 };
    // Page-mapped, cache decay gives pages back during the run too, not only at reclaims.
    let decay_window = if pages { 64 } else { 0 };
    let opts = PoolOptions { kind, check_invariants: true, decay_window, ..Default::default() };
    let mut p = match Pool::new(0, Box::new(up), &opts) {
        Ok(p) => p,
        Err(e) => panic!("{kind:?}: pool creation failed without faults: {e}"),
    };
    let mut rng = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407) | 1;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    // Live blocks: (addr, size, stream, stamp id).
    let mut live: Vec<(usize, usize, StreamHandle, u64)> = Vec::new();
    let mut imports: Imports = Vec::new();
    for i in 0..ops {
        let r = next();
        let stream = STREAMS[(r >> 8) as usize % 3];
        match r % 10 {
            0..=4 => {
                let size = match (r >> 16) % 3 {
                    0 => 1 + (r >> 24) as usize % 4096,
                    1 => 4096 + (r >> 24) as usize % (2 * MIB),
                    // Now and then a block long enough for the arena to map chunks.
                    _ if kind == PoolKind::Arena && (r >> 40) % 16 == 0 => 64 * MIB + (r >> 24) as usize % (32 * MIB),
                    _ => 2 * MIB + (r >> 24) as usize % (12 * MIB),
                };
                match p.malloc(size, stream) {
                    Ok(a) => {
                        for &(b, n, _, _) in &live {
                            assert!(a + size <= b || b + n <= a, "{kind:?}: block {a:#x}+{size} handed out over live {b:#x}+{n}");
                        }
                        if kind == PoolKind::Arena {
                            let g = lock(&s);
                            let first = a & !(HOST_PAGE - 1);
                            if let Some(u) = (first..a + size).step_by(HOST_PAGE).find(|u| !g.real.contains(u)) {
                                panic!("operation {i}: block {a:#x}+{size} handed out over the unmapped granule {u:#x}");
                            }
                        } else if pages {
                            // A write into every page of the block below faults on a
                            // decommitted one; say which first.
                            let g = lock(&s);
                            let first = a & !(HOST_PAGE - 1);
                            if let Some(u) = (first..a + size).step_by(HOST_PAGE).find(|u| g.decommitted.contains(u)) {
                                panic!("{kind:?}, operation {i}: block {a:#x}+{size} handed out over the decommitted page {u:#x}");
                            }
                            drop(g);
                            touch_pages(a, size);
                        }
                        stamp(a, size, i as u64);
                        live.push((a, size, stream, i as u64));
                    }
                    Err(Error::OutOfMemory(_)) | Err(Error::Cuda { .. }) | Err(Error::Internal(_)) => {}
                    Err(e) => panic!("{kind:?}: unexpected error kind {e}"),
                }
            }
            5..=7 if !live.is_empty() => {
                let (a, n, st, id) = live.swap_remove((r >> 20) as usize % live.len());
                check(a, n, id);
                // The exporter keeps a block while others map it: its imports close first.
                while let Some(j) = imports.iter().position(|m| m.2 == a) {
                    close_import(&mut p, &mut imports, j);
                }
                match p.free(a, st) {
                    Ok(()) => {}
                    // A free that failed changed nothing: the block is still the caller's.
                    Err(e) => {
                        assert!(matches!(e, Error::Cuda { .. } | Error::Internal(_)), "{kind:?}: {e}");
                        live.push((a, n, st, id));
                    }
                }
            }
            8 if kind == PoolKind::Arena && (r >> 44) % 2 == 0 => {
                if !imports.is_empty() && (r >> 48) % 3 == 0 {
                    let j = (r >> 20) as usize % imports.len();
                    close_import(&mut p, &mut imports, j);
                } else {
                    // Blocks of a granule or more: smaller ones share their granule with
                    // other live blocks, and their export is refused.
                    let large: Vec<_> = live.iter().filter(|b| b.1 >= HOST_PAGE).map(|&(a, n, _, id)| (a, n, id)).collect();
                    if !large.is_empty() {
                        export_and_import(&mut p, &s, large[(r >> 20) as usize % large.len()], &mut imports, i);
                    } else if !live.is_empty() {
                        let (a, n, _, id) = live[(r >> 20) as usize % live.len()];
                        export_and_import(&mut p, &s, (a, n, id), &mut imports, i);
                    }
                }
            }
            8 if !live.is_empty() => {
                let (a, ..) = live[(r >> 20) as usize % live.len()];
                let _ = p.record_stream(a, STREAMS[(r >> 40) as usize % 3]);
            }
            9 => match (r >> 12) % 3 {
                0 => {
                    let _ = p.reclaim();
                }
                1 => {
                    let _ = p.set_limit(if (r >> 30) % 2 == 0 { 0 } else { 96 * MIB });
                }
                _ => {
                    let _ = p.set_limit(0);
                }
            },
            _ => {}
        }
        if kind == PoolKind::Arena {
            books_agree(&p, &s, i, &imports);
        } else if pages {
            pages_agree(&p, &s, kind, &format!("operation {i}"));
        }
    }
    // Faults stop: everything works and everything goes back.
    let (faults, leaks) = {
        let mut g = lock(&s);
        g.off = true;
        (g.injected, g.leaks)
    };
    p.set_limit(0).unwrap();
    while !imports.is_empty() {
        assert!(close_import(&mut p, &mut imports, 0), "{kind:?}: a close after the faults failed");
    }
    for (a, n, st, id) in live.drain(..) {
        check(a, n, id);
        p.free(a, st).unwrap_or_else(|e| panic!("{kind:?}: free after the faults failed: {e}"));
    }
    let x = p.malloc(64 * MIB, 0xA00).unwrap_or_else(|e| panic!("{kind:?}: allocation after the faults failed: {e}"));
    p.free(x, 0xA00).unwrap();
    p.reclaim().unwrap();
    p.check_invariants().unwrap();
    assert_eq!(p.used_bytes(), 0, "{kind:?}: bytes still counted in use");
    assert_eq!(p.reserved_bytes(), 0, "{kind:?}: memory lost: {} bytes still reserved after freeing all and reclaiming", p.reserved_bytes());
    if pages && kind != PoolKind::Arena {
        pages_agree(&p, &s, kind, "the end");
        assert!(lock(&s).decommitted.is_empty(), "{kind:?}: pages decommitted after every segment went back");
    }
    if kind == PoolKind::Arena {
        books_agree(&p, &s, ops, &imports);
        // Each granule whose release failed is reported as leaked, exactly.
        let leaked = p.arena_figures().unwrap().leaked;
        assert_eq!(leaked, leaks as usize * HOST_PAGE, "granules leaked: {leaks} injected, {leaked} bytes reported");
    }
    let hits = std::mem::take(&mut lock(&s).hits);
    Churned { faults, hits, page_ops: p.page_ops() }
}

const KINDS: [PoolKind; 4] = [PoolKind::Split, PoolKind::Binned, PoolKind::None, PoolKind::Arena];

/// Operations of the long runs, per strategy: `GPUPOOL_FAULT_OPS` (CI sets 400,000).
fn fault_ops() -> usize {
    std::env::var("GPUPOOL_FAULT_OPS").ok().and_then(|v| v.parse().ok()).unwrap_or(20_000)
}

#[test]
fn every_nth_call_failing_loses_nothing() {
    for kind in KINDS {
        let mut total = 0;
        for every in [2, 3, 7, 13] {
            total += churn(kind, every, 0, every, 4_000, &[], false).faults;
        }
        println!("{kind:?}: {total} faults injected (every 2nd/3rd/7th/13th call), survived");
        assert!(total > 100, "{kind:?}: the schedule injected almost nothing ({total})");
    }
}

#[test]
fn seeded_random_faults_lose_nothing() {
    let ops = fault_ops();
    for kind in KINDS {
        let mut total = 0;
        for seed in 1..=4u64 {
            total += churn(kind, 0, 5, seed * 7919, ops / 4, &[], false).faults;
        }
        println!("{kind:?}: {ops} operations, {total} random faults injected, survived");
        assert!(total > 50, "{kind:?}: {total}");
    }
}

/// Only the arena's virtual memory calls fail (at random steps inside them), often, so
/// failures land on every path that maps, aliases, unmaps, removes aliases, exports,
/// imports and closes imports; after every operation the books agree with what is mapped
/// and reserved (`churn`). `GPUPOOL_FAULT_OPS` operations; in a run of 100,000 or more
/// (CI's), every step of every call (`STEPS`) must have failed at least once.
#[test]
fn arena_books_stay_exact_when_virtual_memory_calls_fail() {
    let ops = fault_ops();
    let mut total = 0;
    let mut hits: BTreeMap<&'static str, u64> = BTreeMap::new();
    for (seed, random) in [(11u64, 3u64), (13, 4), (17, 6), (19, 10)] {
        let c = churn(PoolKind::Arena, 0, random, seed * 7919, ops.max(4_000) / 4, VMM_CALLS, false);
        total += c.faults;
        for (k, v) in c.hits {
            *hits.entry(k).or_default() += v;
        }
    }
    println!("Arena: {} operations, {total} virtual memory calls failed, books exact throughout; by step:", ops.max(4_000));
    for step in STEPS {
        println!("  {step:<36} {}", hits.get(step).copied().unwrap_or(0));
    }
    let missed: Vec<&&str> = STEPS.iter().filter(|s| !hits.contains_key(**s)).collect();
    assert!(missed.is_empty() || ops < 100_000, "no failure was injected at {missed:?}");
    assert!(total > 100, "the schedule injected almost nothing ({total})");
}

/// The segment pools' churns, page-mapped with cache decay on: only the page calls fail
/// (often, at random pages inside them), then those and segment releases (a release that
/// fails leaves the cache over its cap, which `binned` answers with page decommits), then
/// every call. After every operation the books agree with what the host backs, no block is
/// handed out over a decommitted page, and once the faults stop all memory goes back
/// (`churn`). `GPUPOOL_FAULT_OPS / 2` operations a strategy (at least 4,000). `split` must
/// have had every step of the page calls (`PAGE_STEPS`) fail; `binned` decommits rarely (a
/// free block of it is a whole segment, released whole where it can be), so only in a run
/// of 100,000 or more (CI's). `none` caches nothing: it never commits or decommits a page.
#[test]
fn segment_pool_books_stay_exact_when_page_calls_fail() {
    let ops = (fault_ops() / 2).max(4_000);
    let runs: [(u64, u64, &'static [&'static str]); 3] =
        [(23, 3, &["commit", "decommit"]), (29, 3, &["commit", "decommit", "deallocate"]), (31, 5, &[])];
    for kind in [PoolKind::Split, PoolKind::Binned, PoolKind::None] {
        let (mut total, mut pages) = (0, (0, 0));
        let mut hits: BTreeMap<&'static str, u64> = BTreeMap::new();
        for (seed, random, only) in runs {
            let c = churn(kind, 0, random, seed * 7919, ops / runs.len(), only, true);
            total += c.faults;
            pages = (pages.0 + c.page_ops.0, pages.1 + c.page_ops.1);
            for (k, v) in c.hits {
                *hits.entry(k).or_default() += v;
            }
        }
        println!("{kind:?}: {ops} operations, page-mapped, {total} faults injected, {} page runs committed and {} decommitted, books exact throughout; failed page calls by step: {hits:?}", pages.0, pages.1);
        if kind == PoolKind::None {
            assert_eq!(pages, (0, 0), "{kind:?}: a pool that caches nothing committed or decommitted pages");
            continue;
        }
        let missed: Vec<&&str> = PAGE_STEPS.iter().filter(|t| !hits.contains_key(**t)).collect();
        assert!(missed.is_empty() || (kind == PoolKind::Binned && fault_ops() < 100_000), "{kind:?}: no failure was injected at {missed:?}");
        assert!(pages.1 > 0 && total > 100, "{kind:?}: the churn decommitted nothing, or injected almost nothing ({total})");
    }
}

/// A pool of `kind` over the page-mapped faulty upstream, no call failing until the
/// schedule says so.
fn faulty_paged(kind: PoolKind) -> (Pool, Arc<Mutex<Schedule>>) {
    let s = Arc::new(Mutex::new(Schedule { pages: true, ..Default::default() }));
    let up = FaultyUpstream { host: HostUpstream::new(256 * MIB), s: s.clone(), next_event: 0 };
    let opts = PoolOptions { kind, check_invariants: true, ..Default::default() };
    (Pool::new(0, Box::new(up), &opts).unwrap(), s)
}

/// A decommit of a free block's pages failing at each page (its unmap, or the release of
/// its memory after the unmap) gives back the pages before it, and that one where only the
/// release failed: the pool books exactly those decommitted and the rest backed, a later
/// reclaim gives the rest back, and blocks over those pages are backed again before they
/// are handed out (a write into every page of them would fault otherwise).
#[test]
fn a_failed_decommit_books_exactly_the_pages_it_gave_back() {
    let (mut p, s) = faulty_paged(PoolKind::Split);
    // A 2 MiB block at the start of a 20 MiB segment: the rest is one free block of
    // `n` whole pages.
    let a = p.malloc(2 * MIB, 0).unwrap();
    stamp(a, 2 * MIB, 1);
    assert_eq!(a % HOST_PAGE, 0, "a segment of a page or more is page aligned");
    let (first, n) = (a + 2 * MIB, 9);
    let pages = |from: usize, to: usize| (from..to).map(|j| first + j * HOST_PAGE).collect::<HashSet<usize>>();
    for k in 0..2 * n {
        fail_only(&s, &["decommit"], 1, Some(k));
        p.reclaim().unwrap();
        let gone = k / 2 + k % 2;
        assert_eq!(lock(&s).decommitted, pages(0, gone), "position {k}: the host decommitted other pages than expected");
        pages_agree(&p, &s, PoolKind::Split, &format!("position {k}"));
        assert_eq!(p.reserved_bytes(), 20 * MIB - gone * HOST_PAGE, "position {k}");
        // Nothing failing, the next reclaim gives the rest back.
        fail_only(&s, &[], 0, None);
        p.reclaim().unwrap();
        assert_eq!(lock(&s).decommitted, pages(0, n), "position {k}: a reclaim left pages backed");
        pages_agree(&p, &s, PoolKind::Split, &format!("position {k}"));
        // The free pages serve blocks again, backed before they are handed out.
        let mut blocks = Vec::new();
        for (j, size) in [8 * MIB, 8 * MIB, 2 * MIB].into_iter().enumerate() {
            let b = p.malloc(size, 0).unwrap();
            assert!(b >= first && b + size <= first + n * HOST_PAGE, "position {k}: the block {b:#x} is not in the free pages");
            assert!(!(b..b + size).step_by(HOST_PAGE).any(|q| lock(&s).decommitted.contains(&q)), "position {k}: block {b:#x}+{size} handed out over a decommitted page");
            touch_pages(b, size);
            stamp(b, size, 100 + j as u64);
            blocks.push((b, size, 100 + j as u64));
        }
        pages_agree(&p, &s, PoolKind::Split, &format!("position {k}"));
        assert!(lock(&s).decommitted.is_empty(), "position {k}");
        for (b, size, id) in blocks {
            check(b, size, id);
            p.free(b, 0).unwrap();
        }
    }
    let hits = lock(&s).hits.clone();
    let missed: Vec<&&str> = PAGE_STEPS.iter().filter(|t| t.starts_with("decommit") && !hits.contains_key(**t)).collect();
    assert!(missed.is_empty(), "steps not failed: {missed:?}");
    check(a, 2 * MIB, 1);
    p.free(a, 0).unwrap();
    p.reclaim().unwrap();
    pages_agree(&p, &s, PoolKind::Split, "the end");
    assert_eq!(p.reserved_bytes(), 0);
    assert!(lock(&s).decommitted.is_empty());
}

/// An arena pool over the faulty upstream, no call failing until the schedule says so.
fn faulty_arena() -> (Pool, Arc<Mutex<Schedule>>) {
    let s = Arc::new(Mutex::new(Schedule::default()));
    let up = FaultyUpstream { host: HostUpstream::new(256 * MIB), s: s.clone(), next_event: 0 };
    let opts = PoolOptions { kind: PoolKind::Arena, check_invariants: true, ..Default::default() };
    (Pool::new(0, Box::new(up), &opts).unwrap(), s)
}

/// From now on the `every`-th call of the kinds `only` fails (at step `at` where set);
/// empty: nothing fails.
fn fail_only(s: &Mutex<Schedule>, only: &'static [&'static str], every: u64, at: Option<usize>) {
    let mut g = lock(s);
    (g.only, g.every, g.at, g.calls, g.export_step) = (only, if only.is_empty() { 0 } else { every }, at, 0, 0);
}

/// An export whose driver call fails at the block's first granule, or at a later one,
/// changes nothing in the arena: the block stays intact and usable, and is not marked
/// exported (the free memory of its granules still serves other blocks, where an export
/// sets it aside).
#[test]
fn a_failed_export_leaves_the_block_usable_and_unexported() {
    let (mut p, s) = faulty_arena();
    // A small block alone in its granule (the rest of the granule is free memory an export
    // sets aside), and a block over three granules or more.
    let small = 256 << 10;
    let a = p.malloc(small, 0).unwrap();
    stamp(a, small, 1);
    let b = p.malloc(5 * MIB, 0).unwrap();
    stamp(b, 5 * MIB, 2);
    for (blk, n, id, every) in [(a, small, 1, 1), (b, 5 * MIB, 2, 1), (b, 5 * MIB, 2, 3)] {
        let before = arena_state(&p);
        fail_only(&s, &["export"], every, None);
        let e = p.ipc_export(blk, false).expect_err("the export was made to fail");
        assert!(matches!(e, Error::Cuda { call: "injected", .. }), "{e}");
        assert_eq!(arena_state(&p), before, "an export that failed at granule {} changed the arena's books", every - 1);
        check(blk, n, id);
    }
    let hits = lock(&s).hits.clone();
    assert!(hits.contains_key("export (first granule)") && hits.contains_key("export (later granule)"), "{hits:?}");
    fail_only(&s, &[], 0, None);
    // Not marked exported: the next small block goes into the free memory of a's granule.
    let c = p.malloc(small, 0).unwrap();
    assert_eq!(c & !(HOST_PAGE - 1), a & !(HOST_PAGE - 1), "a block that failed to export keeps its granule's free memory set aside");
    p.free(c, 0).unwrap();
    // Usable: it exports once the driver works, and the export sets the free memory aside.
    let before = arena_state(&p);
    let d = Descriptor::decode(&p.ipc_export(a, false).unwrap()).unwrap();
    assert_ne!(arena_state(&p), before, "an export sets its granules' free memory aside (what the checks above look for)");
    let fds: Vec<i32> = d.granules.iter().map(|g| g.fd).collect();
    let q = p.ipc_import(&d, Some(&fds)).unwrap();
    check(q, small, 1);
    p.ipc_close(q).unwrap();
    for blk in [a, b] {
        p.free(blk, 0).unwrap();
    }
    p.reclaim().unwrap();
    assert_eq!(p.reserved_bytes(), 0);
}

/// An import failing at each of its steps (the reservation, a granule's descriptor, a
/// granule's map, the access grant; first granule and later ones) leaves nothing behind:
/// no range reserved, no import booked, nothing of the exporter's file mapped; then the
/// import works and closes.
/// A chunk's map fails at each of its steps (the random runs make chunks rarely: the arena
/// maps them only while the device is less than half full): nothing stays mapped or
/// booked. A refused creation is out of memory, so the pool retries granule by granule.
#[test]
fn a_failed_chunk_map_leaves_nothing_mapped() {
    let (mut p, s) = faulty_arena();
    for k in 0..3 {
        fail_only(&s, &["map chunk"], 1, Some(k));
        let r = p.malloc(64 * MIB, 0);
        fail_only(&s, &[], 0, None);
        assert!(lock(&s).violations.is_empty(), "step {k}: {:?}", lock(&s).violations);
        p.check_invariants().unwrap();
        assert_eq!(r.is_ok(), k == 0, "step {k}: only an out-of-memory creation is retried with granules");
        if let Ok(a) = r {
            stamp(a, 64 * MIB, k as u64);
            assert!(intact(a, 64 * MIB, k as u64));
            p.free(a, 0).unwrap();
        }
        p.reclaim().unwrap();
        assert_eq!((p.reserved_bytes(), lock(&s).real_home_bytes), (0, 0), "step {k}: memory left mapped");
    }
    let hits = lock(&s).hits.clone();
    for step in ["map chunk: create", "map chunk: map", "map chunk: set_access"] {
        assert!(hits.contains_key(step), "{step} was not failed: {hits:?}");
    }
    // With nothing failing, the same request is two chunks.
    let a = p.malloc(64 * MIB, 0).unwrap();
    assert!(lock(&s).real.len() >= 32);
    p.free(a, 0).unwrap();
}

#[test]
fn a_failed_import_leaves_nothing_mapped_or_reserved() {
    let (mut p, s) = faulty_arena();
    let b = p.malloc(5 * MIB, 0xA00).unwrap();
    stamp(b, 5 * MIB, 3);
    let d = Descriptor::decode(&p.ipc_export(b, false).unwrap()).unwrap();
    let fds: Vec<i32> = d.granules.iter().map(|g| g.fd).collect();
    let n = d.granules.len();
    assert!(n >= 3);
    let reserved = lock(&s).reserved;
    let file = d.granules[0].file.ino;
    let mapped = mapped_of_file(file);
    assert!(mapped >= 5 * MIB, "the exporter's own mappings of its file are seen");
    for k in 0..2 * n + 2 {
        fail_only(&s, &["import"], 1, Some(k));
        let e = p.ipc_import(&d, Some(&fds)).expect_err("the import was made to fail");
        let g = lock(&s);
        assert!(g.violations.is_empty(), "step {k}: {:?}", g.violations);
        assert_eq!(g.reserved, reserved, "step {k} ({e}): a failed import left address space reserved");
        assert_eq!((g.imports, p.ipc_imports()), (0, 0), "step {k} ({e}): a failed import is booked");
        assert_eq!(mapped_of_file(file), mapped, "step {k} ({e}): a failed import left the exporter's memory mapped");
    }
    let hits = lock(&s).hits.clone();
    let missed: Vec<&&str> = STEPS.iter().filter(|t| t.starts_with("import: ") && **t != "import: close" && !hits.contains_key(**t)).collect();
    assert!(missed.is_empty(), "steps not failed: {missed:?}");
    fail_only(&s, &[], 0, None);
    let q = p.ipc_import(&d, Some(&fds)).unwrap();
    check(q, 5 * MIB, 3);
    assert_eq!(lock(&s).reserved, (reserved.0 + 1, reserved.1 + n * HOST_PAGE));
    // A close that fails leaves the import mapped and booked; the next one closes it.
    fail_only(&s, &["close"], 1, None);
    assert!(p.ipc_close(q).is_err());
    assert_eq!((lock(&s).imports, p.ipc_imports()), (1, 1));
    check(q, 5 * MIB, 3);
    fail_only(&s, &[], 0, None);
    p.ipc_close(q).unwrap();
    assert_eq!(lock(&s).reserved, reserved);
    assert_eq!(mapped_of_file(file), mapped);
    p.free(b, 0xA00).unwrap();
}

#[test]
fn a_panic_inside_a_pool_stops_it_and_it_says_why() {
    use gpupool::ffi::core::*;
    use std::ffi::{c_char, c_void, CStr};
    use std::ptr::null_mut;
    let dev = 9;
    assert_eq!(unsafe { gpupool_configure(dev, c"split".as_ptr(), c"host".as_ptr()) }, gpupool::Status::Ok);
    let mut p: *mut c_void = null_mut();
    assert_eq!(unsafe { gpupool_malloc(&mut p, MIB, dev, null_mut()) }, gpupool::Status::Ok);
    // An operation panics half-way while holding the pool's lock.
    let r = std::panic::catch_unwind(|| {
        let _ = gpupool::registry::with_pool(dev, |_pool| -> gpupool::error::Result<()> { panic!("injected panic inside the pool") });
    });
    assert!(r.is_err());
    let mut q: *mut c_void = null_mut();
    assert_eq!(unsafe { gpupool_malloc(&mut q, MIB, dev, null_mut()) }, gpupool::Status::Stopped);
    let n = unsafe { gpupool_last_error(null_mut(), 0) };
    let mut buf = vec![0u8; n + 1];
    unsafe { gpupool_last_error(buf.as_mut_ptr() as *mut c_char, buf.len()) };
    let msg = CStr::from_bytes_until_nul(&buf).unwrap().to_str().unwrap().to_string();
    assert!(msg.contains("stopped after an internal error"), "{msg}");
    assert!(q.is_null());
    assert_eq!(unsafe { gpupool_free(p, dev, null_mut()) }, gpupool::Status::Stopped, "frees are refused too");
    let n = unsafe { gpupool_memory_status(dev, null_mut(), 0) };
    let mut buf = vec![0u8; n + 1];
    unsafe { gpupool_memory_status(dev, buf.as_mut_ptr() as *mut c_char, buf.len()) };
    let status = CStr::from_bytes_until_nul(&buf).unwrap().to_str().unwrap().to_string();
    assert!(status.contains("STOPPED"), "{status}");
    // Other devices are unaffected.
    assert_eq!(unsafe { gpupool_configure(10, c"split".as_ptr(), c"host".as_ptr()) }, gpupool::Status::Ok);
    assert_eq!(unsafe { gpupool_malloc(&mut q, MIB, 10, null_mut()) }, gpupool::Status::Ok);
    assert_eq!(unsafe { gpupool_free(q, 10, null_mut()) }, gpupool::Status::Ok);
}
