//! The fault-injecting upstream of the fault tests (`faults`, `faults_targeted`): the
//! schedule of which calls fail (`Schedule`), the host upstream wrapped to fail them
//! (`FaultyUpstream`, in `upstream.rs`), and the checks that the pool's books agree with what
//! the host really maps and backs after every operation.
#![allow(dead_code)] // each test crate uses part of it

use crate::common::{intact, MIB};
use gpupool::config::PoolKind;
use gpupool::error::Error;
use gpupool::upstream::host::HostUpstream;
use gpupool::upstream::host::HOST_PAGE;
use gpupool::share::protocol::GranuleDescriptor;
use gpupool::{Pool, PoolOptions};
use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};

mod upstream;
pub use upstream::FaultyUpstream;

pub fn check(a: usize, n: usize, id: u64) {
    assert!(intact(a, n, id), "block {a:#x}+{n} was written by someone else");
}

/// Which calls fail: each kind fails every `every`-th call when set, and every call fails
/// with probability `1/random` from the seeded generator when set (`only`: only the calls
/// of those kinds, by the names `fail` and `fail_vmm` give them, e.g. `VMM_CALLS`; at step
/// `at` where set). Also what the host really maps, kept after every such call.
#[derive(Default)]
pub struct Schedule {
    pub every: u64,
    pub random: u64,
    pub rng: u64,
    pub calls: u64,
    pub injected: u64,
    pub off: bool,
    pub only: &'static [&'static str],
    pub at: Option<usize>,
    /// Granules that show memory now (homes and aliases), and the bytes of the homes: what
    /// the arena's books must agree with.
    pub real: HashSet<usize>,
    pub real_home_bytes: usize,
    /// Address ranges the host has reserved (count, bytes), and the imports it maps.
    pub reserved: (usize, usize),
    pub imports: usize,
    /// Maps the pool asked for over memory still mapped, and failed imports that left
    /// memory mapped (must never happen).
    pub violations: Vec<String>,
    /// Granules (pages) unmapped whose release was made to fail (their memory "leaked").
    pub leaks: u64,
    /// Failures injected into the virtual memory calls, by call and step.
    pub hits: BTreeMap<&'static str, u64>,
    /// Granules of the block being exported asked for so far (the pool exports a block's
    /// granules in order, first to last).
    pub export_step: usize,
    /// Page-mapped: the upstream has pages (`page_size`), which segment pools decommit.
    pub pages: bool,
    /// Pages the host has decommitted now (inaccessible), and the bytes it backs: what a
    /// segment pool's books must agree with.
    pub decommitted: HashSet<usize>,
    pub held: usize,
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
pub const VMM_CALLS: &[&str] = &["map", "map chunk", "unmap", "alias", "unalias", "export", "import", "close"];

/// Every step of every virtual memory call at which a failure is injected (`Schedule::hits`);
/// the long run fails unless each was hit.
pub const STEPS: &[&str] = &[
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
pub const PAGE_STEPS: &[&str] = &[
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
pub fn lock(s: &Mutex<Schedule>) -> std::sync::MutexGuard<'_, Schedule> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}

fn injected(what: &str) -> Error {
    Error::Cuda { call: "injected", code: 999, name: what.to_string() }
}

/// Bytes of this process's mappings of the file with inode `ino` (`/proc/self/maps`).
pub fn mapped_of_file(ino: u64) -> usize {
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

/// Imports open in a churn: (imported address, size, the exported block, its stamp id).
pub type Imports = Vec<(usize, usize, usize, u64)>;

/// The address range an import of a block of `n` bytes at `q` holds: its whole granules.
pub fn import_range(q: usize, n: usize) -> usize {
    (q + n).div_ceil(HOST_PAGE) * HOST_PAGE - (q & !(HOST_PAGE - 1))
}

/// The arena's books against what the host really maps (after operation `i`): the same
/// bytes of memory mapped, the pool never asked to map over mapped memory, no failed import
/// left memory mapped, and the host reserves the arena's ranges and the open imports'
/// alone (a failed import leaves no range behind).
pub fn books_agree(p: &mut Pool, s: &Mutex<Schedule>, i: usize, imports: &Imports) {
    let s = lock(s);
    assert!(s.violations.is_empty(), "operation {i}: {:?}", s.violations);
    let f = p.arena_figures().expect("an arena pool");
    assert_eq!(f.mapped, s.real_home_bytes, "operation {i}: the arena books {} bytes mapped, the host maps {}", f.mapped, s.real_home_bytes);
    assert_eq!(s.imports, imports.len(), "operation {i}: the host maps {} imports, {} are open", s.imports, imports.len());
    let open = p.importer().open_count();
    assert_eq!(open, imports.len(), "operation {i}: the pool counts {open} imports");
    let want = (3 + imports.len(), f.address_space + imports.iter().map(|&(q, n, ..)| import_range(q, n)).sum::<usize>());
    assert_eq!(s.reserved, want, "operation {i}: the host reserves (ranges, bytes) {:?}, the arena and the open imports {want:?}", s.reserved);
}

/// A segment pool's books against what the host really backs (at `at`): the
/// pool holds exactly the bytes the host backs (its segments less the pages booked
/// decommitted; a page decommitted but booked backed, or booked decommitted but backed,
/// shows here), and it never asked to commit a backed page or decommit a decommitted one.
pub fn pages_agree(p: &Pool, s: &Mutex<Schedule>, kind: PoolKind, at: &str) {
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
pub fn touch_pages(a: usize, n: usize) {
    let pages = (a & !(HOST_PAGE - 1)..a + n).step_by(HOST_PAGE);
    for q in pages.map(|p| p.max(a)) {
        // SAFETY: a block the pool handed out on the host upstream; its stamp comes after.
        unsafe { std::ptr::write_volatile(q as *mut u8, 0x5a) };
    }
}

/// What a failed export must leave as it was: the arena's mapped, used and free bytes of
/// each range, its stitches, and the pool's cached and used bytes.
pub fn arena_state(p: &Pool) -> (usize, (usize, usize), (usize, usize), usize, usize, usize) {
    let f = p.arena_figures().expect("an arena pool");
    (f.mapped, f.small, f.large, f.stitches, p.cached_bytes(), p.used_bytes())
}

/// Export the live block at `a` (`n` bytes, stamped `id`) and import the descriptor
/// (its own descriptors passed in, as received over a socket). A failed export leaves the
/// arena's books as they were and the block intact; an import shows the block's bytes.
pub fn export_and_import(p: &mut Pool, s: &Mutex<Schedule>, (a, n, id): (usize, usize, u64), imports: &mut Imports, i: usize) {
    let before = arena_state(p);
    let injected_before = {
        let mut g = lock(s);
        g.export_step = 0;
        g.injected
    };
    match p.ipc_export(a, false) {
        Ok(bytes) => {
            let d = GranuleDescriptor::decode(&bytes).unwrap_or_else(|e| panic!("operation {i}: the descriptor exported does not decode: {e}"));
            let fds: Vec<i32> = d.granules.iter().map(|g| g.fd).collect();
            let injected_before = lock(s).injected;
            match p.importer().import(&d, Some(&fds)) {
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
pub fn close_import(p: &mut Pool, imports: &mut Imports, j: usize) -> bool {
    let (q, n, _, id) = imports[j];
    check(q, n, id);
    match p.importer().close(q) {
        Ok(()) => {
            imports.swap_remove(j);
            true
        }
        Err(Error::Cuda { call: "injected", .. }) => false,
        Err(e) => panic!("close of the import at {q:#x}: unexpected error {e}"),
    }
}

/// A pool of `kind` over the page-mapped faulty upstream, no call failing until the
/// schedule says so.
pub fn faulty_paged(kind: PoolKind) -> (Pool, Arc<Mutex<Schedule>>) {
    let s = Arc::new(Mutex::new(Schedule { pages: true, ..Default::default() }));
    let up = FaultyUpstream { host: HostUpstream::new(256 * MIB), s: s.clone(), next_event: 0 };
    let opts = PoolOptions { kind, check_invariants: true, ..Default::default() };
    (Pool::new(0, Box::new(up), &opts).unwrap(), s)
}

/// An arena pool over the faulty upstream, no call failing until the schedule says so.
pub fn faulty_arena() -> (Pool, Arc<Mutex<Schedule>>) {
    let s = Arc::new(Mutex::new(Schedule::default()));
    let up = FaultyUpstream { host: HostUpstream::new(256 * MIB), s: s.clone(), next_event: 0 };
    let opts = PoolOptions { kind: PoolKind::Arena, check_invariants: true, ..Default::default() };
    (Pool::new(0, Box::new(up), &opts).unwrap(), s)
}

/// Device `device` of the registry as an arena over the faulty upstream (for the C API),
/// no call failing until the schedule says so.
pub fn faulty_arena_device(device: i32) -> Arc<Mutex<Schedule>> {
    let s = Arc::new(Mutex::new(Schedule::default()));
    let up = FaultyUpstream { host: HostUpstream::new(256 * MIB), s: s.clone(), next_event: 0 };
    gpupool::registry::install(device, PoolKind::Arena, Box::new(up)).unwrap();
    s
}

/// From now on the `every`-th call of the kinds `only` fails (at step `at` where set);
/// empty: nothing fails.
pub fn fail_only(s: &Mutex<Schedule>, only: &'static [&'static str], every: u64, at: Option<usize>) {
    let mut g = lock(s);
    (g.only, g.every, g.at, g.calls, g.export_step) = (only, if only.is_empty() { 0 } else { every }, at, 0, 0);
}
