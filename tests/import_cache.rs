//! Another process's memory kept mapped between its messages (`src/share/import_cache.rs`),
//! and the exporter's record behind it, on the host upstream through the C API: device 1
//! exports, device 2 imports by fetching the exporter's descriptors (`pidfd_getfd` on this
//! same process, which the host upstream maps as another's).

use gpupool::ffi::core::{gpupool_free, gpupool_malloc, gpupool_reclaim};
use gpupool::ffi::ipc::{gpupool_ipc_close, gpupool_ipc_export_flags, GPUPOOL_IPC_SHARE_GRANULES};
use gpupool::Status;
use std::ffi::c_void;
use std::ptr::null_mut;

mod common;
use common::last_error as last;

/// The exporter's release count is this process's, moved by any test's reclaim: the tests
/// run one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

const MIB: usize = 1 << 20;
/// Where a descriptor's fields are (`share::protocol`): the record's descriptor number,
/// and the first granule's offset.
const RECORD_FD_AT: usize = 64;
const HEADER_BYTES: usize = gpupool::share::protocol::HEADER_BYTES;

fn malloc(size: usize, d: i32) -> *mut c_void {
    let mut p = null_mut();
    assert_eq!(unsafe { gpupool_malloc(&mut p, size, d, null_mut()) }, Status::Ok, "{}", last());
    p
}

fn free(p: *mut c_void, d: i32) {
    assert_eq!(unsafe { gpupool_free(p, d, null_mut()) }, Status::Ok, "{}", last());
}

fn export(p: *mut c_void) -> Vec<u8> {
    export_flags(p, 0)
}

fn export_flags(p: *mut c_void, flags: u32) -> Vec<u8> {
    common::ipc_export(p as usize, flags)
}

fn open(desc: &[u8], d: i32) -> Result<usize, String> {
    common::ipc_open_by_pid(desc, d)
}

fn close(p: usize, d: i32) {
    common::ipc_close(p, d)
}

/// The number after `"key":` in `device`'s JSON report.
fn figure(d: i32, key: &str) -> u64 {
    let j = common::device_json(d);
    let at = j.find(&format!("\"{key}\":")).unwrap_or_else(|| panic!("{key} in {j}")) + key.len() + 3;
    j[at..].split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
}

fn fill(p: usize, len: usize, byte: u8) {
    unsafe { std::ptr::write_bytes(p as *mut u8, byte, len) };
}

fn reads(p: usize, len: usize, byte: u8) -> bool {
    unsafe { std::slice::from_raw_parts(p as *const u8, len) }.iter().all(|&b| b == byte)
}

#[test]
fn a_block_sent_again_is_served_from_the_kept_mapping_until_the_exporter_releases_memory() {
    let _one = one_at_a_time();
    let (ex, im) = (1, 2);
    common::host_device_256mib(ex, c"arena");
    common::host_device_256mib(im, c"arena");
    let n = 5 * MIB;
    let a = malloc(n, ex);
    fill(a as usize, n, 0x11);
    let desc = export(a);
    let p = open(&desc, im).unwrap();
    assert!(reads(p, n, 0x11));
    let maps = figure(im, "mem_map");
    close(p, im);
    assert_eq!((figure(im, "ipc_imports"), figure(im, "ipc_imports_kept")), (0, 1), "closed, and kept mapped");
    // The block sent again: the same descriptor (one export per block and granule set),
    // served from the kept mapping with no driver call.
    assert_eq!(export(a), desc, "a block exported again keeps its export");
    fill(a as usize, n, 0x22);
    let q = open(&desc, im).unwrap();
    assert_eq!(q, p);
    assert!(reads(q, n, 0x22), "the kept mapping shows the exporter's memory as it is now");
    assert_eq!((figure(im, "mem_map"), figure(im, "ipc_import_reuses")), (maps, 1));
    // Opened twice: one address, closed twice.
    assert_eq!(open(&desc, im).unwrap(), q);
    close(q, im);
    assert_eq!(figure(im, "ipc_imports"), 1);
    close(q, im);
    // A new block in the same memory (the exporter freed the first and allocated again):
    // a new export, the same allocations, still no driver call.
    free(a, ex);
    let b = malloc(n, ex);
    fill(b as usize, n, 0x33);
    let desc_b = export(b);
    assert_ne!(desc_b, desc, "a new block is a new export");
    assert!(open(&desc, im).unwrap_err().contains("no longer exports"), "the freed block's descriptor is stale");
    let r = open(&desc_b, im).unwrap();
    assert!(reads(r, n, 0x33));
    assert_eq!(figure(im, "mem_map"), maps, "the allocations were kept mapped");
    close(r, im);
    // The exporter gives memory back: what was kept of it goes at the importer's next
    // import or close, and the next open maps again.
    free(b, ex);
    let mut released = 0;
    assert_eq!(unsafe { gpupool_reclaim(ex, &mut released) }, Status::Ok, "{}", last());
    assert!(released >= n, "{released}");
    let c = malloc(n, ex);
    fill(c as usize, n, 0x44);
    let desc_c = export(c);
    let s = open(&desc_c, im).unwrap();
    assert!(reads(s, n, 0x44));
    assert!(figure(im, "mem_map") > maps, "new memory is mapped anew");
    assert_eq!(figure(im, "ipc_imports_kept"), 0, "the stale mapping was dropped");
    close(s, im);
    // Emptying the importer's cache unmaps what it kept.
    assert_eq!(figure(im, "ipc_imports_kept"), 1);
    assert_eq!(unsafe { gpupool_reclaim(im, &mut released) }, Status::Ok, "{}", last());
    assert_eq!((figure(im, "ipc_imports_kept"), figure(im, "ipc_import_address_space")), (0, 0));
    free(c, ex);
}

#[test]
fn sending_one_block_a_hundred_thousand_times_uses_one_export() {
    let _one = one_at_a_time();
    let d = 3;
    common::host_device_256mib(d, c"arena");
    let a = malloc(3 * MIB, d);
    let first = export(a);
    // Past the record's 65,536 slots: re-sends reuse the block's export.
    for _ in 0..100_000 {
        assert_eq!(export(a), first);
    }
    free(a, d);
    // Freed: the export ended, and a new block exports afresh.
    let b = malloc(3 * MIB, d);
    assert_ne!(export(b), first);
    free(b, d);
}

#[test]
fn a_descriptor_whose_granules_were_changed_is_refused() {
    let _one = one_at_a_time();
    let (ex, im) = (4, 5);
    common::host_device_256mib(ex, c"arena");
    common::host_device_256mib(im, c"arena");
    let a = malloc(5 * MIB, ex);
    let other = malloc(5 * MIB, ex);
    // Neighbours may share a granule: exported as the framework routes export them.
    let desc = export_flags(a, GPUPOOL_IPC_SHARE_GRANULES);
    let desc_other = export_flags(other, GPUPOOL_IPC_SHARE_GRANULES);
    // The first granule's entry swapped for one of another block's, exported too: each
    // entry names exported memory, but not under this token.
    let mut forged = desc.clone();
    forged[HEADER_BYTES..HEADER_BYTES + 32].copy_from_slice(&desc_other[HEADER_BYTES..HEADER_BYTES + 32]);
    let e = open(&forged, im).unwrap_err();
    assert!(e.contains("forged or altered"), "{e}");
    assert_eq!(figure(im, "ipc_imports"), 0);
    let p = open(&desc, im).unwrap();
    close(p, im);
    free(a, ex);
    free(other, ex);
}

#[test]
fn the_export_record_cannot_be_resized_or_written_by_those_who_read_it() {
    let _one = one_at_a_time();
    let d = 6;
    common::host_device_256mib(d, c"arena");
    let a = malloc(3 * MIB, d);
    let desc = export(a);
    let fd = i32::from_le_bytes(desc[RECORD_FD_AT..RECORD_FD_AT + 4].try_into().unwrap());
    // An importer's copy is a descriptor of the same file: a duplicate stands for it.
    let theirs = unsafe { libc::dup(fd) };
    assert!(theirs >= 0);
    let seals = unsafe { libc::fcntl(theirs, libc::F_GET_SEALS) };
    assert!(seals & libc::F_SEAL_SHRINK != 0 && seals & libc::F_SEAL_GROW != 0, "seals {seals:#x}");
    assert_ne!(unsafe { libc::ftruncate(theirs, 0) }, 0, "a reader truncated the record");
    if seals & libc::F_SEAL_FUTURE_WRITE != 0 {
        let zero = [0u8; 8];
        assert!(unsafe { libc::pwrite(theirs, zero.as_ptr().cast(), 8, 32) } < 0, "a reader wrote a token");
    }
    unsafe { libc::close(theirs) };
    // The exporter still records and ends its exports.
    free(a, d);
    let b = malloc(3 * MIB, d);
    export(b);
    free(b, d);
}

/// An export racing the fast-path free of the same block (the freeing thread's cache takes
/// it without the pool's lock): either the export is refused (the block was freed), or it
/// is made and ends with the free, so its descriptor no longer opens; never an export that
/// outlives its block.
#[test]
fn an_export_racing_a_fast_path_free_never_outlives_the_block() {
    let _one = one_at_a_time();
    let (ex, im) = (7, 8);
    common::host_device_256mib(ex, c"arena");
    common::host_device_256mib(im, c"arena");
    let (to_exporter, blocks) = std::sync::mpsc::channel::<usize>();
    let (to_freer, exported) = std::sync::mpsc::channel::<Option<Vec<u8>>>();
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(2));
    let b2 = barrier.clone();
    let exporter = std::thread::spawn(move || {
        for p in blocks {
            b2.wait();
            let mut desc = vec![0u8; 4096];
            let mut len = 0;
            let st = unsafe { gpupool_ipc_export_flags(p as *mut c_void, GPUPOOL_IPC_SHARE_GRANULES, desc.as_mut_ptr().cast(), desc.len(), &mut len) };
            to_freer.send((st == Status::Ok).then(|| desc[..len].to_vec())).unwrap();
        }
    });
    let (mut made, mut refused) = (0, 0);
    for _ in 0..5000 {
        // Small: the thread's cache hands it out and takes it back on free.
        let p = malloc(4096, ex);
        to_exporter.send(p as usize).unwrap();
        barrier.wait();
        free(p, ex);
        match exported.recv().unwrap() {
            Some(desc) => {
                made += 1;
                let e = open(&desc, im).expect_err("an export outlived its freed block");
                assert!(e.contains("no longer exports"), "{e}");
            }
            None => refused += 1,
        }
    }
    drop(to_exporter);
    exporter.join().unwrap();
    assert!(made > 0, "no export was made before its free ({refused} refused): the race was not run");
    assert_eq!(figure(ex, "n_live_blocks"), 0);
}

/// A block closed twice: the second close is refused, and the kept mapping stays the
/// cache's (before, the upstream unmapped it behind the cache's books).
#[test]
fn a_second_close_of_a_kept_import_is_refused() {
    let _one = one_at_a_time();
    let (ex, im) = (9, 10);
    common::host_device_256mib(ex, c"arena");
    common::host_device_256mib(im, c"arena");
    let a = malloc(3 * MIB, ex);
    fill(a as usize, 3 * MIB, 0x7E);
    let desc = export(a);
    let p = open(&desc, im).unwrap();
    close(p, im);
    assert_eq!(gpupool_ipc_close(p as *mut c_void, im), Status::InvalidPointer);
    assert!(last().contains("closed already"), "{}", last());
    assert_eq!((figure(im, "ipc_imports"), figure(im, "ipc_imports_kept")), (0, 1));
    let q = open(&desc, im).unwrap();
    assert!(q == p && reads(q, 3 * MIB, 0x7E));
    // An address inside the open block is not a block closed already: it is refused as such.
    assert_eq!(gpupool_ipc_close((q + 4096) as *mut c_void, im), Status::InvalidPointer);
    assert!(last().contains("inside") && last().contains("gpupool_ipc_open returned"), "{}", last());
    close(q, im);
    free(a, ex);
}

#[test]
fn a_failed_import_by_pid_keeps_none_of_the_exporters_descriptors_open() {
    let _one = one_at_a_time();
    let (ex, im) = (1, 2);
    common::host_device_256mib(ex, c"arena");
    common::host_device_256mib(im, c"arena");
    let a = malloc(3 * MIB, ex);
    let desc = export(a);
    free(a, ex);
    // Nothing kept of this exporter: its opening would be new.
    let mut released = 0;
    assert_eq!(unsafe { gpupool_reclaim(im, &mut released) }, Status::Ok, "{}", last());
    let count = || std::fs::read_dir("/proc/self/fd").unwrap().count();
    let before = count();
    for _ in 0..3 {
        assert!(open(&desc, im).unwrap_err().contains("no longer exports"));
    }
    assert_eq!(count(), before, "the exporter's pidfd and record are closed with the failed import");
}
