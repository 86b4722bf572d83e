//! Faults, one at a time: each step of a driver call made to fail alone, on the fault-injecting
//! upstream of `faults_support/` (a page decommit at each page, an export at its first or a
//! later granule, a chunk's map at each step, an import at each step and its close), each
//! leaving the pool's books exact and nothing mapped, reserved or backed that should not be;
//! and a panic inside a pool stops that pool instead of letting it hand out memory from
//! half-updated books. The long random runs are in `faults.rs`.

#[macro_use]
mod common;
mod faults_support;

use common::{intact, stamp, MIB};
use faults_support::*;
use gpupool::config::PoolKind;
use gpupool::error::Error;
use gpupool::upstream::host::HOST_PAGE;
use gpupool::share::protocol::GranuleDescriptor;
use std::collections::HashSet;

/// One test at a time: a receiver's kept imports of this process's own memory go stale
/// whenever the process releases memory, and a pause wakes every keeper here; a test running
/// beside another would see both.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

/// A decommit of a free block's pages failing at each page (its unmap, or the release of
/// its memory after the unmap) gives back the pages before it, and that one where only the
/// release failed: the pool books exactly those decommitted and the rest backed, a later
/// reclaim gives the rest back, and blocks over those pages are backed again before they
/// are handed out (a write into every page of them would fault otherwise).
#[test]
fn a_failed_decommit_books_exactly_the_pages_it_gave_back() {
    let _serial = one_at_a_time();
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

/// An export whose driver call fails at the block's first granule, or at a later one,
/// changes nothing in the arena: the block stays intact and usable, and is not marked
/// exported (the free memory of its granules still serves other blocks, where an export
/// sets it aside).
#[test]
fn a_failed_export_leaves_the_block_usable_and_unexported() {
    let _serial = one_at_a_time();
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
    let d = GranuleDescriptor::decode(&p.ipc_export(a, false).unwrap()).unwrap();
    assert_ne!(arena_state(&p), before, "an export sets its granules' free memory aside (what the checks above look for)");
    let fds: Vec<i32> = d.granules.iter().map(|g| g.fd).collect();
    let q = p.importer().import(&d, Some(&fds)).unwrap();
    check(q, small, 1);
    p.importer().close(q).unwrap();
    for blk in [a, b] {
        p.free(blk, 0).unwrap();
    }
    p.reclaim().unwrap();
    assert_eq!(p.reserved_bytes(), 0);
}

/// A chunk's map fails at each of its steps (the random runs make chunks rarely: the arena
/// maps them only while the device is less than half full): nothing stays mapped or
/// booked. A refused creation is out of memory, so the pool retries granule by granule.
#[test]
fn a_failed_chunk_map_leaves_nothing_mapped() {
    let _serial = one_at_a_time();
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

/// An import failing at each of its steps (the reservation, a granule's descriptor, a
/// granule's map, the access grant; first granule and later ones) leaves nothing behind:
/// no range reserved, no import booked, nothing of the exporter's file mapped; then the
/// import works and closes.
#[test]
fn a_failed_import_leaves_nothing_mapped_or_reserved() {
    let _serial = one_at_a_time();
    let (mut p, s) = faulty_arena();
    let b = p.malloc(5 * MIB, 0xA00).unwrap();
    stamp(b, 5 * MIB, 3);
    let d = GranuleDescriptor::decode(&p.ipc_export(b, false).unwrap()).unwrap();
    let fds: Vec<i32> = d.granules.iter().map(|g| g.fd).collect();
    let n = d.granules.len();
    assert!(n >= 3);
    let reserved = lock(&s).reserved;
    let file = d.granules[0].file.ino;
    let mapped = mapped_of_file(file);
    assert!(mapped >= 5 * MIB, "the exporter's own mappings of its file are seen");
    for k in 0..2 * n + 2 {
        fail_only(&s, &["import"], 1, Some(k));
        let e = p.importer().import(&d, Some(&fds)).expect_err("the import was made to fail");
        let g = lock(&s);
        assert!(g.violations.is_empty(), "step {k}: {:?}", g.violations);
        assert_eq!(g.reserved, reserved, "step {k} ({e}): a failed import left address space reserved");
        assert_eq!((g.imports, p.importer().open_count()), (0, 0), "step {k} ({e}): a failed import is booked");
        assert_eq!(mapped_of_file(file), mapped, "step {k} ({e}): a failed import left the exporter's memory mapped");
    }
    let hits = lock(&s).hits.clone();
    let missed: Vec<&&str> = STEPS.iter().filter(|t| t.starts_with("import: ") && **t != "import: close" && !hits.contains_key(**t)).collect();
    assert!(missed.is_empty(), "steps not failed: {missed:?}");
    fail_only(&s, &[], 0, None);
    let q = p.importer().import(&d, Some(&fds)).unwrap();
    check(q, 5 * MIB, 3);
    assert_eq!(lock(&s).reserved, (reserved.0 + 1, reserved.1 + n * HOST_PAGE));
    // A close that fails leaves the import mapped and booked; the next one closes it.
    fail_only(&s, &["close"], 1, None);
    assert!(p.importer().close(q).is_err());
    assert_eq!((lock(&s).imports, p.importer().open_count()), (1, 1));
    check(q, 5 * MIB, 3);
    fail_only(&s, &[], 0, None);
    p.importer().close(q).unwrap();
    assert_eq!(lock(&s).reserved, reserved);
    assert_eq!(mapped_of_file(file), mapped);
    p.free(b, 0xA00).unwrap();
}

#[test]
fn a_panic_inside_a_pool_stops_it_and_it_says_why() {
    let _serial = one_at_a_time();
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

/// The close of an import with a hold fails (its wait for this process's work, or an
/// unmap): the hold stays held, so the exporter does not reuse memory that work may still
/// write; the tensor's deleter says so and loses nothing else.
#[test]
fn a_failed_close_keeps_its_exporters_hold() {
    let _serial = one_at_a_time();
    use gpupool::ffi::ipc::{gpupool_ipc_descriptor_fds, gpupool_ipc_export_flags, GPUPOOL_IPC_SHARE_GRANULES};
    use gpupool::ffi::share::{gpupool_ipc_open_dlpack, gpupool_share_held, gpupool_share_hold};
    use gpupool::Status;
    use std::ffi::c_void;
    use std::ptr::null_mut;
    let d = 40;
    let s = faulty_arena_device(d);
    let mut block = null_mut();
    assert_eq!(unsafe { gpupool::ffi::core::gpupool_malloc(&mut block, 3 * MIB, d, null_mut()) }, Status::Ok);
    let mut desc = vec![0u8; 4096];
    let mut len = 0;
    assert_eq!(unsafe { gpupool_ipc_export_flags(block, GPUPOOL_IPC_SHARE_GRANULES, desc.as_mut_ptr().cast(), desc.len(), &mut len) }, Status::Ok);
    desc.truncate(len);
    let mut fds = vec![0i32; 64];
    let mut n = 0;
    assert_eq!(unsafe { gpupool_ipc_descriptor_fds(desc.as_ptr().cast(), desc.len(), fds.as_mut_ptr(), fds.len(), &mut n) }, Status::Ok);
    let (mut holds_fd, mut slot) = (0, 0);
    assert_eq!(unsafe { gpupool_share_hold(&mut holds_fd, &mut slot) }, Status::Ok);
    let mut t: *mut c_void = null_mut();
    let st = unsafe { gpupool_ipc_open_dlpack(desc.as_ptr().cast(), desc.len(), d, fds.as_ptr(), n, holds_fd, slot, &mut t) };
    assert_eq!(st, Status::Ok);
    let held = |slot| {
        let mut h = -1;
        assert_eq!(unsafe { gpupool_share_held(slot, &mut h) }, Status::Ok);
        h == 1
    };
    fail_only(&s, &["close"], 1, None);
    // DLPack's deleter: the second pointer-sized word after the tensor's fields.
    #[repr(C)]
    struct Head {
        fields: [u8; 48],
        ctx: *mut c_void,
        deleter: Option<unsafe extern "C" fn(*mut c_void)>,
    }
    let head = t.cast::<Head>();
    unsafe { ((*head).deleter.unwrap())(t) };
    assert!(held(slot), "a failed close released its exporter's hold");
    fail_only(&s, &[], 0, None);
}

/// A tagged import's close keeps its mapping for the next message; the sender's pause asks
/// for it back, and the receiver's unmap fails then: the mapping stays kept and counted
/// (the pause returns after its wait, the memory released on the sender's side), and a
/// later drop unmaps it. Where imports cannot fetch by pid, the close unmaps, and a failed
/// unmap keeps the block open and counted.
#[test]
fn a_failed_unmap_of_a_kept_tagged_import_keeps_it_until_a_later_drop() {
    let _serial = one_at_a_time();
    use gpupool::ffi::core::gpupool_reclaim;
    use gpupool::ffi::ipc::gpupool_ipc_close;
    use gpupool::ffi::tags::{gpupool_tag_begin, gpupool_tag_end, gpupool_tag_pause, gpupool_tag_resume};
    use gpupool::Status;
    use std::ptr::null_mut;
    let (d, r) = (44, 45);
    common::host_device_256mib(d, c"arena");
    let s = faulty_arena_device(r);
    assert_eq!(unsafe { gpupool_tag_begin(c"closing".as_ptr()) }, Status::Ok);
    let a = common::malloc_on(3 * MIB, d);
    assert_eq!(gpupool_tag_end(), Status::Ok);
    let p = common::ipc_open_by_pid(&common::ipc_export(a, 1), r).unwrap();
    let pause = || {
        let mut n = 0;
        unsafe { gpupool_tag_pause(d, c"closing".as_ptr(), null_mut(), 1, &mut n) }
    };
    let kept = || {
        let j = common::device_json(r);
        let at = j.find("\"ipc_imports_kept\":").expect("the figure") + "\"ipc_imports_kept\":".len();
        j[at..].split(|c: char| !c.is_ascii_digit()).next().unwrap().parse::<u64>().unwrap()
    };
    assert_eq!(pause(), Status::Busy, "a block open in the receiver: {}", common::last_error());
    if !common::pidfd_works() {
        // No pidfd (valgrind, an old kernel): the import came through the handover socket,
        // whose descriptors the receiver cannot tell are still current, so its close
        // unmaps. A failed unmap leaves the block open and counted, and the pause refused.
        fail_only(&s, &["close"], 1, None);
        assert_ne!(gpupool_ipc_close(p as *mut std::ffi::c_void, r), Status::Ok, "the unmap failed");
        fail_only(&s, &[], 0, None);
        assert_eq!(pause(), Status::Busy, "a block whose close failed is still mapped: {}", common::last_error());
        assert_eq!(gpupool_ipc_close(p as *mut std::ffi::c_void, r), Status::Ok, "{}", common::last_error());
        assert_eq!(kept(), 0);
        assert_eq!(pause(), Status::Ok, "{}", common::last_error());
        let mut n = 0;
        assert_eq!(unsafe { gpupool_tag_resume(d, c"closing".as_ptr(), &mut n) }, Status::Ok);
        common::free_on(a, d);
        return;
    }
    assert_eq!(gpupool_ipc_close(p as *mut std::ffi::c_void, r), Status::Ok, "{}", common::last_error());
    assert_eq!(kept(), 1, "the close keeps the mapping");
    fail_only(&s, &["close"], 1, None);
    let t = std::time::Instant::now();
    assert_eq!(pause(), Status::Ok, "{}", common::last_error());
    assert!(t.elapsed() >= gpupool::share::keepers::KEEPERS_WAIT, "the pause waited for the keeper");
    fail_only(&s, &[], 0, None);
    assert_eq!(kept(), 1, "a mapping whose unmap failed stays kept (and counted)");
    let mut n = 0;
    assert_eq!(unsafe { gpupool_reclaim(r, &mut n) }, Status::Ok, "{}", common::last_error());
    assert_eq!(kept(), 0, "a later drop unmaps it");
    assert_eq!(unsafe { gpupool_tag_resume(d, c"closing".as_ptr(), &mut n) }, Status::Ok);
    // Counted no more: the next pause does not wait.
    let t = std::time::Instant::now();
    assert_eq!(pause(), Status::Ok, "{}", common::last_error());
    assert!(t.elapsed() < gpupool::share::keepers::KEEPERS_WAIT, "the pause waited for a keeper that keeps nothing");
    assert_eq!(unsafe { gpupool_tag_resume(d, c"closing".as_ptr(), &mut n) }, Status::Ok);
    common::free_on(a, d);
}
