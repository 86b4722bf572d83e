//! Tags and pausing (`docs/tags.md`) on the host upstream through the C API: a tag's
//! allocations come from memory of their own; a pause gives that memory back (the
//! device's free figure rises by it) keeping every address, and a resume maps it again
//! with its contents. Paused memory is inaccessible on the host as on a GPU, so a test
//! that read it would crash rather than pass.

use gpupool::ffi::core::{gpupool_configure, gpupool_free, gpupool_malloc};
use gpupool::ffi::cupy::{gpupool_cupy_free, gpupool_cupy_malloc, gpupool_cupy_set_stream_getter};
use gpupool::ffi::ipc::gpupool_ipc_export_flags;
use gpupool::ffi::tags::{gpupool_tag_begin, gpupool_tag_drop_backup, gpupool_tag_end, gpupool_tag_pause, gpupool_tag_paused_bytes, gpupool_tag_resume};
use gpupool::Status;
use std::ffi::{c_void, CStr};
use std::ptr::null_mut;

mod common;
use common::last_error as last;

const MIB: usize = 1 << 20;

/// Every allocation under a tag is this size (Note [A tag's granule]).
use gpupool::tags::TAG_GRANULE;

/// One test at a time: a process's kept imports of its own memory go stale whenever it
/// releases memory (the host upstream counts every granule's release), which a test running
/// beside another would see as a receiver that let go too early.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

/// The environment every test here reads: devices on the host upstream (a device no test
/// configures gets it from here), before the first call reads the configuration.
fn host_env() {
    static ENV: std::sync::Once = std::sync::Once::new();
    ENV.call_once(|| {
        std::env::set_var("GPUPOOL_HOST_CAPACITY", "256MiB");
        std::env::set_var("GPUPOOL_UPSTREAM", "host");
    });
}

/// Device `d` as an arena on the host upstream.
fn host(d: i32) {
    host_env();
    common::host_device_256mib(d, c"arena");
}

fn malloc(size: usize, d: i32) -> Result<usize, String> {
    let mut p = null_mut();
    match unsafe { gpupool_malloc(&mut p, size, d, null_mut()) } {
        Status::Ok => Ok(p as usize),
        _ => Err(last()),
    }
}

fn free(p: usize, d: i32) {
    assert_eq!(unsafe { gpupool_free(p as *mut c_void, d, null_mut()) }, Status::Ok, "{}", last());
}

fn begin(tag: &CStr) {
    assert_eq!(unsafe { gpupool_tag_begin(tag.as_ptr()) }, Status::Ok, "{}", last());
}

fn end() {
    assert_eq!(gpupool_tag_end(), Status::Ok, "{}", last());
}

fn pause(d: i32, tag: &CStr, backup: bool) -> Result<usize, String> {
    let mut n = 0;
    match unsafe { gpupool_tag_pause(d, tag.as_ptr(), null_mut(), backup as i32, &mut n) } {
        Status::Ok => Ok(n),
        _ => Err(last()),
    }
}

/// The refusal of a pause (with a backup) while a receiver maps the tag's memory, or
/// `None` where the pause was not refused as busy.
fn busy_refusal(d: i32, tag: &CStr) -> Option<String> {
    let mut n = 0;
    let st = unsafe { gpupool_tag_pause(d, tag.as_ptr(), null_mut(), 1, &mut n) };
    (st == Status::Busy).then(last)
}

fn resume(d: i32, tag: &CStr) -> Result<usize, String> {
    let mut n = 0;
    match unsafe { gpupool_tag_resume(d, tag.as_ptr(), &mut n) } {
        Status::Ok => Ok(n),
        _ => Err(last()),
    }
}

fn paused_bytes(d: i32, tag: &CStr) -> usize {
    let mut n = usize::MAX;
    assert_eq!(unsafe { gpupool_tag_paused_bytes(d, tag.as_ptr(), &mut n) }, Status::Ok, "{}", last());
    n
}

/// The number after `"key":` in `device`'s JSON report, from `from` on.
fn figure_after(d: i32, from: &str, key: &str) -> u64 {
    let j = common::device_json(d);
    let start = j.find(from).unwrap_or_else(|| panic!("{from} in {j}"));
    let at = j[start..].find(&format!("\"{key}\":")).unwrap_or_else(|| panic!("{key} in {j}")) + start + key.len() + 3;
    j[at..].split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
}

fn device_free(d: i32) -> u64 {
    figure_after(d, "{", "device_free_bytes")
}

fn fill(p: usize, len: usize, seed: u8) {
    let s = unsafe { std::slice::from_raw_parts_mut(p as *mut u8, len) };
    for (i, b) in s.iter_mut().enumerate() {
        *b = seed.wrapping_add((i % 251) as u8);
    }
}

fn holds(p: usize, len: usize, seed: u8) -> bool {
    let s = unsafe { std::slice::from_raw_parts(p as *const u8, len) };
    s.iter().enumerate().all(|(i, &b)| b == seed.wrapping_add((i % 251) as u8))
}

#[test]
fn a_paused_tag_gives_its_memory_back_and_resumes_at_the_same_addresses_with_its_contents() {
    let _serial = one_at_a_time();
    let d = 20;
    host(d);
    let untagged = malloc(3 * MIB, d).unwrap();
    fill(untagged, 3 * MIB, 1);
    begin(c"weights");
    let sizes = [5 * MIB, 300 << 10, 12 * MIB, 4096];
    let blocks: Vec<usize> = sizes.iter().map(|&s| malloc(s, d).unwrap()).collect();
    end();
    for (i, (&p, &s)) in blocks.iter().zip(&sizes).enumerate() {
        fill(p, s, 10 + i as u8);
    }
    // Granules of their own: no tagged block shares a 2 MiB granule with the untagged one.
    let g = 2 * MIB;
    for &p in &blocks {
        assert!(p / g != untagged / g && p / g != (untagged + 3 * MIB - 1) / g);
    }
    assert_eq!(figure_after(d, "\"weights\"", "n_live_blocks"), 4);
    let free_before = device_free(d);
    let released = pause(d, c"weights", true).unwrap();
    assert!(released >= sizes.iter().sum::<usize>(), "released {released}");
    assert_eq!(device_free(d) - free_before, released as u64, "the device got the tag's memory back");
    assert_eq!(paused_bytes(d, c"weights") as u64, figure_after(d, "\"weights\"", "paused_bytes"));
    assert!(common::memory_status(d).contains("Tag \"weights\""), "{}", common::memory_status(d));

    // While paused: allocations under the tag and exports of its blocks are refused, saying
    // why; untagged work goes on; a free waits for the resume; a second pause is refused.
    begin(c"weights");
    let e = malloc(MIB, d).unwrap_err();
    end();
    assert!(e.contains("`weights`") && e.contains("paused"), "{e}");
    let mut desc = vec![0u8; 4096];
    let mut len = 0;
    let st = unsafe { gpupool_ipc_export_flags(blocks[0] as *mut c_void, 1, desc.as_mut_ptr().cast(), desc.len(), &mut len) };
    assert_ne!(st, Status::Ok);
    assert!(last().contains("paused"), "{}", last());
    let other = malloc(MIB, d).unwrap();
    assert!(holds(untagged, 3 * MIB, 1));
    free(blocks[3], d);
    assert_eq!(pause(d, c"weights", true).unwrap(), 0, "a paused tag counts as paused");

    let paused = paused_bytes(d, c"weights");
    assert!(paused > 0 && paused <= released);
    let restored = resume(d, c"weights").unwrap();
    assert_eq!(restored, paused);
    assert_eq!(paused_bytes(d, c"weights"), 0);
    for (i, (&p, &s)) in blocks.iter().zip(&sizes).enumerate().take(3) {
        assert!(holds(p, s, 10 + i as u8), "block {i} lost its contents");
    }
    assert_eq!(figure_after(d, "\"weights\"", "n_live_blocks"), 3, "the free made while paused was done by the resume");
    assert_eq!(resume(d, c"weights").unwrap(), 0, "a tag not paused resumes nothing");
    for &p in &blocks[..3] {
        free(p, d);
    }
    free(other, d);
    free(untagged, d);
}

#[test]
fn stitched_blocks_resume_with_their_aliases() {
    let _serial = one_at_a_time();
    let d = 21;
    host(d);
    let g = TAG_GRANULE;
    begin(c"stitched");
    // Scattered free granules, then a request no run of them serves: a stitch.
    let singles: Vec<usize> = (0..6).map(|_| malloc(g, d).unwrap()).collect();
    for &p in singles.iter().step_by(2) {
        free(p, d);
    }
    let big = malloc(3 * g, d).unwrap();
    end();
    assert!(figure_after(d, "\"arena\"", "stitches_made") > 0, "no stitch: {}", common::device_json(d));
    fill(big, 3 * g, 40);
    for (i, &p) in singles.iter().enumerate().skip(1).step_by(2) {
        fill(p, g, 50 + i as u8);
    }
    pause(d, c"stitched", true).unwrap();
    resume(d, c"stitched").unwrap();
    assert!(holds(big, 3 * g, 40), "the stitched block lost its contents");
    for (i, &p) in singles.iter().enumerate().skip(1).step_by(2) {
        assert!(holds(p, g, 50 + i as u8));
        free(p, d);
    }
    free(big, d);
}

#[test]
fn a_hundred_switches_keep_memory_and_address_space_flat() {
    let _serial = one_at_a_time();
    let d = 22;
    host(d);
    begin(c"trainer");
    let model = malloc(4 * MIB, d).unwrap();
    let optimizer = malloc(6 * MIB, d).unwrap();
    end();
    begin(c"rollout");
    let kv = malloc(8 * MIB, d).unwrap();
    end();
    fill(model, 4 * MIB, 3);
    let free_at_start = device_free(d);
    let reserved_at_start = figure_after(d, "{", "total_bytes");
    for step in 0..100u32 {
        // The trainer sleeps, the rollout engine wakes (its cache is discarded), and back.
        pause(d, c"trainer", true).unwrap();
        resume(d, c"rollout").unwrap();
        fill(kv, MIB, step as u8);
        pause(d, c"rollout", false).unwrap();
        resume(d, c"trainer").unwrap();
        assert!(holds(model, 4 * MIB, 3), "step {step}");
        if step == 0 {
            // The first rollout pause gave its memory (a granule) back: from here on each
            // step ends where this one does.
            assert_eq!(device_free(d), free_at_start + TAG_GRANULE as u64);
        }
        assert_eq!(device_free(d), free_at_start + TAG_GRANULE as u64, "step {step}");
        assert_eq!(figure_after(d, "{", "total_bytes"), reserved_at_start, "step {step}");
    }
    resume(d, c"rollout").unwrap();
    let mut kept = 0;
    assert_eq!(unsafe { gpupool_tag_drop_backup(d, c"trainer".as_ptr(), &mut kept) }, Status::Ok);
    for (p, _) in [(model, 0), (optimizer, 0), (kv, 0)] {
        free(p, d);
    }
}

#[test]
fn bad_tags_and_strategies_that_cannot_pause_are_refused_with_the_cause() {
    let _serial = one_at_a_time();
    let d = 23;
    assert!(pause(d, c"never-used", true).unwrap_err().contains("never named"), "{}", last());
    assert_eq!(unsafe { gpupool_tag_begin(std::ptr::null()) }, Status::NullArgument);
    assert_eq!(unsafe { gpupool_tag_begin(c"".as_ptr()) }, Status::InvalidArgument);
    assert_eq!(gpupool_tag_end(), Status::InvalidArgument, "an end without a begin");
    host_env();
    assert_eq!(unsafe { gpupool_configure(d, c"split".as_ptr(), c"host".as_ptr()) }, Status::Ok, "{}", last());
    begin(c"segments");
    let p = malloc(MIB, d).unwrap();
    end();
    let e = pause(d, c"segments", true).unwrap_err();
    assert!(e.contains("arena"), "{e}");
    free(p, d);
}

/// CuPy's current stream as its getter reports it: a user stream.
unsafe extern "C" fn a_user_stream() -> isize {
    0x7000
}

#[test]
fn cupy_allocations_on_a_user_stream_are_the_tags() {
    let _serial = one_at_a_time();
    let d = 24;
    host(d);
    unsafe { gpupool_cupy_set_stream_getter(Some(a_user_stream)) };
    begin(c"cupy-user");
    let p = unsafe { gpupool_cupy_malloc(null_mut(), 3 * MIB, d) } as usize;
    end();
    assert_ne!(p, 0, "{}", last());
    assert_eq!(figure_after(d, "\"cupy-user\"", "n_live_blocks"), 1);
    fill(p, 3 * MIB, 77);
    pause(d, c"cupy-user", true).unwrap();
    resume(d, c"cupy-user").unwrap();
    assert!(holds(p, 3 * MIB, 77));
    unsafe { gpupool_cupy_free(null_mut(), p as *mut c_void, d) };
    assert_eq!(figure_after(d, "\"cupy-user\"", "n_live_blocks"), 0);
}

#[test]
fn a_tag_allocated_first_on_its_device_pauses_when_every_device_is_asked() {
    let _serial = one_at_a_time();
    // Not configured: the tagged allocation is the device's first call.
    let d = 25;
    host_env();
    begin(c"first-on-device");
    let p = malloc(4 * MIB, d).unwrap();
    end();
    fill(p, 4 * MIB, 9);
    assert!(pause(-1, c"first-on-device", true).unwrap() >= 4 * MIB, "the device is known to every-device calls");
    assert_eq!(pause(-1, c"first-on-device", true).unwrap(), 0, "a device paused already counts as done");
    assert!(paused_bytes(d, c"first-on-device") >= 4 * MIB);
    resume(-1, c"first-on-device").unwrap();
    assert!(holds(p, 4 * MIB, 9));
    free(p, d);
}

/// The RL trainer's loop: weights under a tag sent to another process, which copies them and
/// closes its import; the trainer pauses, resumes and sends again, a hundred times. Device 43
/// sends, device 44 receives (the host upstream maps this same process's memory as another's).
#[test]
fn send_receive_close_pause_resume_send_again_keeps_memory_flat_and_contents_intact() {
    let _serial = one_at_a_time();
    use gpupool::ffi::ipc::{gpupool_ipc_close, gpupool_ipc_open};
    let (d, r) = (43, 44);
    host(d);
    host(r);
    begin(c"weights");
    let w = malloc(5 * MIB, d).unwrap();
    end();
    let export = || {
        let mut desc = vec![0u8; 4096];
        let mut len = 0;
        let st = unsafe { gpupool_ipc_export_flags(w as *mut c_void, 1, desc.as_mut_ptr().cast(), desc.len(), &mut len) };
        assert_eq!(st, Status::Ok, "{}", last());
        desc.truncate(len);
        desc
    };
    let mut free_after_first = 0;
    for cycle in 0..100u8 {
        fill(w, 5 * MIB, cycle);
        let desc = export();
        let mut p = null_mut();
        let st = unsafe { gpupool_ipc_open(desc.as_ptr().cast(), desc.len(), r, std::ptr::null(), 0, &mut p) };
        assert_eq!(st, Status::Ok, "{}", last());
        assert!(holds(p as usize, 5 * MIB, cycle), "cycle {cycle}: the receiver sees the weights");
        if cycle == 0 {
            // While the receiver maps it, the pause refuses, naming the block and the
            // receiving process, and changes nothing.
            let why = busy_refusal(d, c"weights").unwrap_or_else(|| panic!("a pause while the receiver maps the block: {}", last()));
            assert!(why.contains(&format!("{w:#x}")) && why.contains(&format!("process {}", std::process::id())), "{why}");
            assert!(why.contains("let go"), "{why}");
            assert_eq!(paused_bytes(d, c"weights"), 0);
            assert!(holds(p as usize, 5 * MIB, cycle) && holds(w, 5 * MIB, cycle));
        }
        assert_eq!(gpupool_ipc_close(p, r), Status::Ok, "{}", last());
        // The receiver keeps the mapping for the next message, which it serves with no
        // driver call.
        assert_eq!(figure_after(r, "{", "ipc_imports_kept"), 1, "cycle {cycle}: the receiver keeps the tag's mapping");
        let (reuses, calls) = (figure_after(r, "{", "ipc_import_reuses"), figure_after(r, "\"driver_calls\"", "total"));
        let mut again = null_mut();
        let st = unsafe { gpupool_ipc_open(desc.as_ptr().cast(), desc.len(), r, std::ptr::null(), 0, &mut again) };
        assert_eq!(st, Status::Ok, "{}", last());
        assert!(holds(again as usize, 5 * MIB, cycle));
        assert_eq!(figure_after(r, "{", "ipc_import_reuses"), reuses + 1, "cycle {cycle}: the re-send is served from the kept mapping");
        assert_eq!(figure_after(r, "\"driver_calls\"", "total"), calls, "cycle {cycle}: the re-send made a driver call");
        assert_eq!(gpupool_ipc_close(again, r), Status::Ok, "{}", last());
        assert!(pause(d, c"weights", true).unwrap() > 0, "cycle {cycle}: a sent tag pauses once its receiver let go");
        // The pause returned once the receiver dropped its kept mapping of the memory.
        assert_eq!(figure_after(r, "{", "ipc_imports_kept"), 0, "cycle {cycle}: the receiver still keeps the paused memory");
        // What was sent before the pause names memory given back: refused.
        let st = unsafe { gpupool_ipc_open(desc.as_ptr().cast(), desc.len(), r, std::ptr::null(), 0, &mut p) };
        assert_ne!(st, Status::Ok);
        assert!(last().contains("no longer exports"), "{}", last());
        resume(d, c"weights").unwrap();
        assert!(holds(w, 5 * MIB, cycle), "cycle {cycle}: the weights resumed intact");
        if cycle == 0 {
            free_after_first = device_free(d);
        }
        assert_eq!(device_free(d), free_after_first, "cycle {cycle}: memory stays flat");
    }
    free(w, d);
}

#[test]
fn reconfiguring_while_a_tag_is_paused_with_its_blocks_freed_says_to_resume_it() {
    let _serial = one_at_a_time();
    let d = 42;
    host(d);
    begin(c"asleep");
    let a = malloc(3 * MIB, d).unwrap();
    end();
    pause(d, c"asleep", false).unwrap();
    free(a, d);
    let st = unsafe { gpupool_configure(d, c"split".as_ptr(), c"host".as_ptr()) };
    assert_eq!(st, Status::Busy);
    assert!(last().contains("`asleep` is paused") && last().contains("resume it first"), "{}", last());
    resume(d, c"asleep").unwrap();
    assert_eq!(unsafe { gpupool_configure(d, c"arena".as_ptr(), c"host".as_ptr()) }, Status::Ok, "{}", last());
}

/// The arena's chunks on device `d` (physical allocations of several granules), over
/// every pool of the device.
fn chunks(d: i32) -> u64 {
    figure_after(d, "\"arena\"", "chunks")
}

#[test]
fn a_tags_memory_is_mapped_in_allocations_of_one_size() {
    let _serial = one_at_a_time();
    // What PyTorch's expandable-segment handle describes, so that a receiver on PyTorch's
    // own allocator opens every tagged block (Note [PyTorch's handle formats]). A growth of
    // an odd number of granules past the chunking threshold: untagged it is mapped as
    // chunks and a granule, allocations of mixed sizes; tagged, granule by granule. Each
    // case on a device of its own, each the first growth there (chunking stops once half
    // the device is reserved).
    let sizes = [4000, (68 << 20) + 1];
    let (t, u) = (45, 46);
    host(t);
    host(u);
    begin(c"weights");
    let tagged: Vec<usize> = sizes.iter().map(|&n| malloc(n, t).unwrap()).collect();
    end();
    let untagged: Vec<usize> = sizes.iter().map(|&n| malloc(n, u).unwrap()).collect();
    assert_eq!(chunks(t), 0, "{}", common::device_json(t));
    assert!(chunks(u) > 0, "{}", common::device_json(u));
    // Allocations of the tag's granule: one in the small range, three under 68 MiB.
    assert_eq!(figure_after(t, "\"arena\"", "granule"), TAG_GRANULE as u64);
    assert_eq!(figure_after(t, "\"arena\"", "granules_mapped"), 4, "{}", common::device_json(t));
    // An export lists the device's granularity, so that any importer maps it: each of the
    // tag's granules is consecutive entries of one allocation.
    let mut desc = vec![0u8; 1 << 16];
    let mut len = 0;
    let st = unsafe { gpupool_ipc_export_flags(tagged[1] as *mut c_void, 1, desc.as_mut_ptr().cast(), desc.len(), &mut len) };
    assert_eq!(st, Status::Ok, "{}", last());
    let d = gpupool::share::protocol::GranuleDescriptor::decode(&desc[..len]).unwrap();
    let device_granule = gpupool::upstream::host::HOST_PAGE as u64;
    assert_eq!(d.granule, device_granule);
    assert_eq!(d.granules.len() as u64, 3 * TAG_GRANULE as u64 / device_granule);
    for (i, e) in d.granules.iter().enumerate() {
        let first = &d.granules[i - i % (TAG_GRANULE / device_granule as usize)];
        assert_eq!(e.offset - first.offset, (i % (TAG_GRANULE / device_granule as usize)) as u64 * device_granule, "entry {i}");
    }
    for p in tagged {
        free(p, t);
    }
    for p in untagged {
        free(p, u);
    }
}

#[test]
fn a_backup_prepared_ahead_serves_the_first_pause_and_stays_until_dropped() {
    let _serial = one_at_a_time();
    use gpupool::ffi::tags::gpupool_tag_prepare_backup;
    let d = 47;
    host(d);
    let prepare = |name: &CStr| {
        let mut n = 0;
        match unsafe { gpupool_tag_prepare_backup(d, name.as_ptr(), &mut n) } {
            Status::Ok => Ok(n),
            _ => Err(last()),
        }
    };
    begin(c"prepared");
    let w = malloc(40 * MIB, d).unwrap();
    end();
    fill(w, 40 * MIB, 9);
    let mapped = figure_after(d, "\"prepared\"", "total_bytes") as usize;
    let host_allocs = || figure_after(d, "\"driver_calls\"", "host_alloc");
    assert_eq!(host_allocs(), 0);
    let n = prepare(c"prepared").unwrap();
    assert!(n >= mapped && mapped >= 40 * MIB, "prepared {n} bytes for {mapped} mapped");
    assert_eq!(prepare(c"prepared").unwrap(), n, "a second request keeps the buffer");
    assert_eq!(host_allocs(), 1);
    pause(d, c"prepared", true).unwrap();
    assert_eq!(host_allocs(), 1, "the first pause allocated a buffer of its own");
    assert!(prepare(c"prepared").unwrap_err().contains("paused"), "{}", last());
    resume(d, c"prepared").unwrap();
    assert!(holds(w, 40 * MIB, 9), "the weights came back through the prepared buffer");
    let mut dropped = 0;
    assert_eq!(unsafe { gpupool_tag_drop_backup(d, c"prepared".as_ptr(), &mut dropped) }, Status::Ok, "{}", last());
    assert_eq!(dropped, n, "the buffer the first pause used is the prepared one");
    assert!(prepare(c"never-named-here").unwrap_err().contains("never named"), "{}", last());
    free(w, d);
}

/// Receivers' open imports, as the pause counts them (`share::protocol::opens_file`): through
/// descriptors passed in, across an export slot reused by another block, and over every
/// device at once.
#[test]
fn a_pause_counts_every_open_import_and_refuses_on_no_device_when_one_is_open() {
    let _serial = one_at_a_time();
    use gpupool::ffi::ipc::{gpupool_ipc_close, gpupool_ipc_descriptor_fds, gpupool_ipc_open};
    let (d, e, r) = (48, 49, 50);
    host(d);
    host(e);
    host(r);
    let export = |p: usize| common::ipc_export(p, 1);
    let open = |desc: &[u8]| {
        let mut p = null_mut();
        assert_eq!(unsafe { gpupool_ipc_open(desc.as_ptr().cast(), desc.len(), r, std::ptr::null(), 0, &mut p) }, Status::Ok, "{}", last());
        p
    };
    let close = |p: *mut c_void| assert_eq!(gpupool_ipc_close(p, r), Status::Ok, "{}", last());
    let busy = |dev: i32| busy_refusal(dev, c"counted");
    begin(c"counted");
    let a = malloc(3 * MIB, d).unwrap();
    let on_e = malloc(3 * MIB, e).unwrap();
    end();

    // Opened with the exporter's descriptors passed in (this process's numbers are its own).
    let desc = export(a);
    let mut n = 0;
    let mut fds = vec![0i32; 64];
    assert_eq!(unsafe { gpupool_ipc_descriptor_fds(desc.as_ptr().cast(), desc.len(), fds.as_mut_ptr(), fds.len(), &mut n) }, Status::Ok);
    let mut p = null_mut();
    let st = unsafe { gpupool_ipc_open(desc.as_ptr().cast(), desc.len(), r, fds.as_ptr(), n, &mut p) };
    assert_eq!(st, Status::Ok, "{}", last());
    assert!(busy(d).is_some(), "an import given its descriptors is not counted");
    close(p);

    // A late close of an ended export does not take away the open of the block that took
    // its slot next.
    let old = open(&desc);
    free(a, d);
    begin(c"counted");
    let b = malloc(3 * MIB, d).unwrap();
    end();
    let new = open(&export(b));
    close(old);
    let why = busy(d).expect("the pause went through while the new block is open");
    assert!(why.contains(&format!("{b:#x}")), "{why}");

    // Over every device: one device's open import refuses the pause everywhere, and none
    // is paused.
    close(new);
    let there = open(&export(on_e));
    assert!(busy(-1).is_some(), "a pause of every device went through while a block of one is open");
    assert_eq!(paused_bytes(-1, c"counted"), 0, "a refused pause paused a device");
    close(there);
    let sent = export(b);
    let mut theirs = vec![0i32; 64];
    let mut k = 0;
    assert_eq!(unsafe { gpupool_ipc_descriptor_fds(sent.as_ptr().cast(), sent.len(), theirs.as_mut_ptr(), theirs.len(), &mut k) }, Status::Ok);
    assert!(pause(-1, c"counted", true).unwrap() > 0);
    // What was sent before the pause names released memory: refused, descriptors passed
    // in or not, and counted nowhere.
    let mut q = null_mut();
    let st = unsafe { gpupool_ipc_open(sent.as_ptr().cast(), sent.len(), r, theirs.as_ptr(), k, &mut q) };
    assert_ne!(st, Status::Ok, "an import of paused memory was mapped");
    assert!(last().contains("no longer exports"), "{}", last());
    resume(-1, c"counted").unwrap();
    // No count was left behind: the pause goes through (and is resumed).
    assert!(busy(d).is_none(), "a refused import left a count behind");
    resume(-1, c"counted").unwrap();
    free(b, d);
    free(on_e, e);
}

/// A receiver run as a process of its own: this test binary again, running the ignored
/// test `name` with the descriptor `desc` (hex) in `TAGS_TEST_DESC` and the file it answers
/// through in `TAGS_TEST_ANSWER`, its input a pipe.
fn spawn_receiver(name: &str, desc: &[u8], answer: &std::path::Path) -> std::process::Child {
    use std::process::{Command, Stdio};
    let _ = std::fs::remove_file(answer);
    let hex: String = desc.iter().map(|b| format!("{b:02x}")).collect();
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--ignored", "--test-threads=1"])
        .env("TAGS_TEST_DESC", hex)
        .env("TAGS_TEST_ANSWER", answer)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap()
}

/// In a receiver: the descriptor and the answer file `spawn_receiver` passed (None when run
/// as a plain test).
fn receiver_args() -> Option<(Vec<u8>, String)> {
    let (Ok(hex), Ok(answer)) = (std::env::var("TAGS_TEST_DESC"), std::env::var("TAGS_TEST_ANSWER")) else { return None };
    Some(((0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect(), answer))
}

/// In a receiver: write `text` to the answer file whole (renamed into place).
fn answer(path: &str, text: &str) {
    std::fs::write(format!("{path}.tmp"), text).unwrap();
    std::fs::rename(format!("{path}.tmp"), path).unwrap();
}

/// The receiver's next answer (the file is taken away once read); a receiver that exits or
/// takes a minute fails the test.
fn next_answer(child: &mut std::process::Child, path: &std::path::Path) -> String {
    let started = std::time::Instant::now();
    loop {
        if let Ok(text) = std::fs::read_to_string(path) {
            let _ = std::fs::remove_file(path);
            return text.trim().to_string();
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the receiver ended before it answered: {status}");
        }
        assert!(started.elapsed().as_secs() < 60, "the receiver did not answer in a minute");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// The receiver of `a_receiver_that_exited_without_closing_counts_no_more`, run by it as a
/// process of its own (`spawn_receiver`): opens the descriptor, answers its pid, and exits
/// when its input closes, without closing the import.
#[test]
#[ignore]
fn receiver_process() {
    use std::io::BufRead;
    let Some((desc, opened)) = receiver_args() else { return };
    host(60);
    common::ipc_open_by_pid(&desc, 60).unwrap();
    answer(&opened, &std::process::id().to_string());
    let _ = std::io::stdin().lock().lines().next();
    std::process::exit(0); // the import stays open: the process is gone with it
}

#[test]
fn a_receiver_that_exited_without_closing_counts_no_more() {
    let _serial = one_at_a_time();
    let d = 51;
    host(d);
    begin(c"left-open");
    let w = malloc(3 * MIB, d).unwrap();
    end();
    let opened = std::env::temp_dir().join(format!("gpupool-tags-opened-{}", std::process::id()));
    let mut child = spawn_receiver("receiver_process", &common::ipc_export(w, 1), &opened);
    let pid: u32 = next_answer(&mut child, &opened).parse().unwrap();
    let why = busy_refusal(d, c"left-open").unwrap_or_else(|| panic!("the receiver maps the block: {}", last()));
    assert!(why.contains(&format!("process {pid}")), "{why}");
    drop(child.stdin.take()); // the receiver exits, its import still open
    assert!(child.wait().unwrap().success());
    assert!(pause(d, c"left-open", true).unwrap() > 0, "an exited receiver still counts");
    resume(d, c"left-open").unwrap();
    free(w, d);
}

/// Note [A tag's memory]: a tag placed as cuda-ipc is a `split` pool of segments, sent in
/// PyTorch's CUDA-IPC form; its pause is refused naming the choice; the choice is refused
/// while the tag holds memory and taken once it holds none.
#[test]
fn a_tag_placed_as_cuda_ipc_is_segments_that_send_as_cuda_ipc_handles_and_never_pause() {
    let _serial = one_at_a_time();
    use gpupool::ffi::ipc::gpupool_ipc_export_torch;
    use gpupool::ffi::tags::gpupool_tag_place;
    let d = 26;
    host(d);
    let place = |memory: &CStr| match unsafe { gpupool_tag_place(c"bucket".as_ptr(), memory.as_ptr()) } {
        Status::Ok => Ok(()),
        st => Err((st, last())),
    };
    let e = place(c"cudaipc").unwrap_err();
    assert_eq!(e.0, Status::InvalidArgument);
    assert!(e.1.contains("pausable | cuda-ipc"), "{}", e.1);
    assert_eq!(unsafe { gpupool_tag_place(c"bucket".as_ptr(), std::ptr::null()) }, Status::NullArgument);
    place(c"cuda-ipc").unwrap();
    let n = unsafe { gpupool::ffi::tags::gpupool_tag_names(null_mut(), 0) };
    let mut names = vec![0 as std::ffi::c_char; n + 1];
    assert_eq!(unsafe { gpupool::ffi::tags::gpupool_tag_names(names.as_mut_ptr(), names.len()) }, n);
    let names = unsafe { CStr::from_ptr(names.as_ptr()) }.to_str().unwrap().to_owned();
    assert!(names.lines().any(|l| l == "bucket\tcuda-ipc"), "{names}");

    begin(c"bucket");
    let p = malloc(3 * MIB, d).unwrap();
    end();
    let j = common::device_json(d);
    let at = j.find("\"bucket\":").expect("the tag's report");
    assert!(j[at..].starts_with("\"bucket\":{\"memory\":\"cuda-ipc\""), "{j}");
    assert!(j.contains("\"strategy\":\"split\""), "the tag's pool is segments: {j}");
    // Host memory has no CUDA IPC handle: the export takes that route and says so (on a
    // GPU it is PyTorch's `c` form, tests/python/test_share_receivers.py).
    let mut buf = vec![0u8; 4096];
    let (mut len, mut offset) = (0, 0);
    let st = unsafe { gpupool_ipc_export_torch(p as *mut c_void, buf.as_mut_ptr().cast(), buf.len(), &mut len, &mut offset) };
    assert_eq!(st, Status::InvalidArgument);
    assert!(last().contains("CUDA's IPC handles"), "{}", last());

    let e = pause(d, c"bucket", true).unwrap_err();
    assert!(e.contains("cuda-ipc") && e.contains("free"), "{e}");
    let e = place(c"pausable").unwrap_err();
    assert_eq!(e.0, Status::Busy);
    assert!(e.1.contains("device 26") && e.1.contains("1 live"), "{}", e.1);
    assert!(common::device_json(d).contains("\"memory\":\"cuda-ipc\""), "the refusal changed nothing");

    free(p, d);
    place(c"pausable").unwrap();
    begin(c"bucket");
    let q = malloc(3 * MIB, d).unwrap();
    end();
    assert!(common::device_json(d).contains("\"bucket\":{\"memory\":\"pausable\""));
    fill(q, 3 * MIB, 5);
    pause(d, c"bucket", true).unwrap();
    resume(d, c"bucket").unwrap();
    assert!(holds(q, 3 * MIB, 5));
    free(q, d);
}

/// Note [Graph pools under a tag]: a private pool (a CUDA graph's, a `MemPool`'s) begun
/// under a tag lives in the tag's pool; its memory pauses and resumes with the tag, at the
/// same addresses, with its contents; the pause is refused while its route is active; its
/// release gives the memory back. A route begun outside every tag keeps its allocations
/// out of the tag even from a thread under it.
#[test]
fn a_private_pool_begun_under_a_tag_is_the_tags_memory_and_pauses_with_it() {
    let _serial = one_at_a_time();
    use gpupool::ffi::graph::{gpupool_begin_allocate_to_pool, gpupool_end_allocate_to_pool, gpupool_release_pool};
    let d = 27;
    host(d);
    let tag_figure = |key: &str| figure_after(d, "\"engine\":", key);
    begin(c"engine");
    let weights = malloc(MIB, d).unwrap();
    assert_eq!(unsafe { gpupool_begin_allocate_to_pool(d, 11, null_mut()) }, Status::Ok, "{}", last());
    end();
    // Outside the tag now: the route (the legacy stream's) still takes it, into the tag.
    let reserved_before = tag_figure("total_bytes");
    let graph = malloc(3 * MIB, d).unwrap();
    assert_eq!(tag_figure("n_live_blocks"), 2, "the routed block is the tag's");
    assert!(tag_figure("total_bytes") >= reserved_before + TAG_GRANULE as u64, "a segment of the tag's granule");
    let e = busy_refusal(d, c"engine").expect("a pause with a route active is refused");
    assert!(e.contains("capture or MemPool"), "{e}");
    assert_eq!(gpupool_end_allocate_to_pool(d, 11), Status::Ok, "{}", last());

    fill(graph, 3 * MIB, 31);
    let free_before = device_free(d);
    let released = pause(d, c"engine", true).unwrap();
    assert!(released >= 2 * TAG_GRANULE, "the weights' granule and the graph's segment: {released}");
    assert!(device_free(d) >= free_before + 2 * TAG_GRANULE as u64);
    resume(d, c"engine").unwrap();
    assert!(holds(graph, 3 * MIB, 31), "the graph's memory came back at its address with its contents");

    free(graph, d);
    let reserved = tag_figure("total_bytes");
    assert_eq!(gpupool_release_pool(d, 11), Status::Ok, "{}", last());
    assert_eq!(tag_figure("total_bytes"), reserved - TAG_GRANULE as u64, "the released pool's segment went back");

    // A route begun outside every tag: a tagged allocation it takes is the graph's.
    assert_eq!(unsafe { gpupool_begin_allocate_to_pool(d, 12, null_mut()) }, Status::Ok, "{}", last());
    begin(c"engine");
    let outside = malloc(MIB, d).unwrap();
    end();
    assert_eq!(gpupool_end_allocate_to_pool(d, 12), Status::Ok, "{}", last());
    assert_eq!(tag_figure("n_live_blocks"), 1, "only the weights are the tag's");
    free(outside, d);
    assert_eq!(gpupool_release_pool(d, 12), Status::Ok, "{}", last());
    free(weights, d);
}

/// A graph made under a tag keeps the tag's memory: placing the tag elsewhere is refused
/// while the graph's pool lives, naming it; a graph released while its tag sleeps goes
/// back at the resume, without an error.
#[test]
fn a_tags_graph_pool_blocks_a_new_place_and_is_released_after_a_pause() {
    let _serial = one_at_a_time();
    use gpupool::ffi::graph::{gpupool_begin_allocate_to_pool, gpupool_end_allocate_to_pool, gpupool_release_pool};
    use gpupool::ffi::tags::gpupool_tag_place;
    let d = 28;
    host(d);
    let tag_figure = |key: &str| figure_after(d, "\"sleeper\":", key);
    begin(c"sleeper");
    let w = malloc(MIB, d).unwrap();
    assert_eq!(unsafe { gpupool_begin_allocate_to_pool(d, 51, null_mut()) }, Status::Ok, "{}", last());
    let g = malloc(3 * MIB, d).unwrap();
    free(g, d);
    assert_eq!(gpupool_end_allocate_to_pool(d, 51), Status::Ok, "{}", last());
    end();
    free(w, d);
    // Nothing live, but the graph (one use of pool 51) still holds its memory.
    let st = unsafe { gpupool_tag_place(c"sleeper".as_ptr(), c"cuda-ipc".as_ptr()) };
    assert_eq!(st, Status::Busy);
    assert!(last().contains("CUDA graph or MemPool"), "{}", last());
    assert!(common::device_json(d).contains("\"sleeper\":{\"memory\":\"pausable\""), "nothing changed");

    let w = malloc(MIB, d).unwrap(); // the tag's weights, outside the tag: untagged
    begin(c"sleeper");
    let kept = malloc(MIB, d).unwrap();
    end();
    pause(d, c"sleeper", true).unwrap();
    assert_eq!(gpupool_release_pool(d, 51), Status::Ok, "a graph destroyed during the sleep: {}", last());
    let reserved = tag_figure("total_bytes");
    resume(d, c"sleeper").unwrap();
    assert_eq!(tag_figure("total_bytes"), reserved - TAG_GRANULE as u64, "the released graph's memory went at the resume");
    free(kept, d);
    free(w, d);
}

/// The tensors of one message under a tag lie in the tag's few allocations: a receiver maps
/// each allocation once while blocks over it are open (Note [Keeping imports mapped]), each
/// block still counted apart for the sender's pause, keeps it after the last close, and
/// unmaps it when the sender's pause asks.
#[test]
fn blocks_of_one_message_share_one_mapping_of_a_tags_allocation_while_open() {
    let _serial = one_at_a_time();
    let (d, r) = (31, 32);
    host(d);
    host(r);
    begin(c"message");
    let blocks: Vec<usize> = (0..4u8).map(|_| malloc(3 * MIB, d).unwrap()).collect();
    end();
    for (i, &b) in blocks.iter().enumerate() {
        fill(b, 3 * MIB, 40 + i as u8);
    }
    let descs: Vec<Vec<u8>> = blocks.iter().map(|&b| common::ipc_export(b, 1)).collect();
    let maps = || figure_after(r, "\"driver_calls\"", "mem_map");
    let before = maps();
    let first = common::ipc_open_by_pid(&descs[0], r).unwrap();
    let one_import = maps() - before;
    assert!(one_import > 0);
    let mut opened = vec![first];
    opened.extend(descs[1..].iter().map(|desc| common::ipc_open_by_pid(desc, r).unwrap()));
    assert_eq!(maps() - before, one_import, "the other blocks of the allocation were served by its mapping");
    for (i, &p) in opened.iter().enumerate() {
        assert!(holds(p, 3 * MIB, 40 + i as u8), "block {i} reads the sender's memory");
    }
    for &p in &opened[..3] {
        common::ipc_close(p, r);
    }
    let why = busy_refusal(d, c"message").expect("one block is still open");
    assert!(why.contains(&format!("{:#x}", blocks[3])), "{why}");
    let unmaps = figure_after(r, "\"driver_calls\"", "mem_unmap");
    common::ipc_close(opened[3], r);
    assert_eq!(figure_after(r, "\"driver_calls\"", "mem_unmap"), unmaps, "the last close keeps the mapping for the next message");
    pause(d, c"message", true).unwrap();
    assert!(figure_after(r, "\"driver_calls\"", "mem_unmap") > unmaps, "the pause had the receiver unmap the allocation");
    resume(d, c"message").unwrap();
    for &b in &blocks {
        free(b, d);
    }
}

/// The receiver of `a_receiver_in_another_process_gives_a_tags_memory_back_on_its_pause`,
/// run by it as a process of its own (`spawn_receiver`): opens the descriptor and closes it
/// (its mapping kept for a next message), then answers how many mappings it keeps, and again
/// at each line of its input; exits when its input closes.
#[test]
#[ignore]
fn keeping_receiver_process() {
    use std::io::BufRead;
    let Some((desc, out)) = receiver_args() else { return };
    host(61);
    let p = common::ipc_open_by_pid(&desc, 61).unwrap();
    common::ipc_close(p, 61);
    let report = || answer(&out, &figure_after(61, "{", "ipc_imports_kept").to_string());
    report();
    for _ in std::io::stdin().lock().lines().map_while(|l| l.ok()) {
        report();
    }
}

#[test]
fn a_receiver_in_another_process_gives_a_tags_memory_back_on_its_pause() {
    let _serial = one_at_a_time();
    use std::io::Write;
    let d = 52;
    host(d);
    begin(c"kept-elsewhere");
    let w = malloc(3 * MIB, d).unwrap();
    end();
    fill(w, 3 * MIB, 5);
    let kept = std::env::temp_dir().join(format!("gpupool-tags-kept-{}", std::process::id()));
    let mut child = spawn_receiver("keeping_receiver_process", &common::ipc_export(w, 1), &kept);
    let read = |child: &mut std::process::Child| -> u64 { next_answer(child, &kept).parse().unwrap() };
    assert_eq!(read(&mut child), 1, "the receiver keeps the tag's mapping after its close");
    let t = std::time::Instant::now();
    assert!(pause(d, c"kept-elsewhere", true).unwrap() >= 3 * MIB);
    // Ended by the keeper's count reaching zero, not by the wait's end: the receiver's
    // watcher dropped its mapping before the pause returned.
    assert!(t.elapsed() < std::time::Duration::from_secs(1), "the pause waited {:?}", t.elapsed());
    writeln!(child.stdin.as_mut().unwrap()).unwrap();
    assert_eq!(read(&mut child), 0, "the receiver still keeps the paused memory");
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
    resume(d, c"kept-elsewhere").unwrap();
    assert!(holds(w, 3 * MIB, 5));
    free(w, d);
}
