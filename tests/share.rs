//! The frameworks' process-sharing route through the C API on the host upstream: a small
//! block (sharing its granule with others) exports only when asked to share granules, a
//! hold stays held until the import's DLPack deleter runs, and the deleter closes the
//! import. Both ends are this process here (the host upstream maps its own exports as
//! another process's); `tests/python/test_share.py` runs them in two.

use gpupool::ffi::core::{gpupool_free, gpupool_malloc};
use gpupool::ffi::ipc::{gpupool_ipc_close, gpupool_ipc_descriptor_fds, gpupool_ipc_export, gpupool_ipc_export_flags, GPUPOOL_IPC_SHARE_GRANULES};
use gpupool::ffi::share::{gpupool_dlpack_give_back_count, gpupool_ipc_open_dlpack, gpupool_share_held, gpupool_share_held_count, gpupool_share_hold, gpupool_share_release};
use gpupool::ffi::share_ahead::{gpupool_share_end_ahead, gpupool_share_open_ahead, gpupool_share_take_ahead};
use gpupool::Status;
use std::ffi::c_void;
use std::ptr::null_mut;

mod common;
use common::last_error as last;

/// The parts of a `DLManagedTensor` the test reads (DLPack's unversioned layout).
#[repr(C)]
struct DlTensorHead {
    data: *mut c_void,
    device_type: i32,
    device_id: i32,
    ndim: i32,
    dtype: [u8; 4],
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlTensorHead)>,
}

fn malloc(size: usize, d: i32) -> *mut c_void {
    let mut p = null_mut();
    assert_eq!(unsafe { gpupool_malloc(&mut p, size, d, null_mut()) }, Status::Ok, "{}", last());
    p
}

fn export(p: *mut c_void, flags: u32) -> Result<Vec<u8>, String> {
    let mut desc = vec![0u8; 4096];
    let mut len = 0;
    match unsafe { gpupool_ipc_export_flags(p, flags, desc.as_mut_ptr().cast(), desc.len(), &mut len) } {
        Status::Ok => Ok(desc[..len].to_vec()),
        _ => Err(last()),
    }
}

fn fds(desc: &[u8]) -> Vec<i32> {
    let mut n = 0;
    let mut out = vec![0i32; 64];
    assert_eq!(unsafe { gpupool_ipc_descriptor_fds(desc.as_ptr().cast(), desc.len(), out.as_mut_ptr(), out.len(), &mut n) }, Status::Ok);
    out.truncate(n);
    out
}

fn held(slot: u32) -> bool {
    let mut h = -1;
    assert_eq!(unsafe { gpupool_share_held(slot, &mut h) }, Status::Ok, "{}", last());
    h == 1
}

#[test]
fn a_small_block_is_shared_held_and_let_go_through_its_dlpack_deleter() {
    let d = 61;
    common::host_device_256mib(d, c"arena");
    let (a, b) = (malloc(4096, d), malloc(4096, d));
    unsafe { std::ptr::copy_nonoverlapping(b"shared!".as_ptr(), b.cast::<u8>(), 7) };
    // The strict route refuses a block whose granule holds another live block; the
    // framework route exports it.
    let mut len = 0;
    assert_eq!(unsafe { gpupool_ipc_export(b, null_mut(), 0, &mut len) }, Status::Ok, "asking the length exports nothing");
    assert_eq!(len, gpupool::share::protocol::HEADER_BYTES + gpupool::share::protocol::GRANULE_BYTES);
    let strict = export(b, 0);
    assert!(strict.as_ref().is_err_and(|e| e.contains("shares its")), "{strict:?}");
    assert!(export(b, 0x8).is_err_and(|e| e.contains("unknown flags")));
    let desc = export(b, GPUPOOL_IPC_SHARE_GRANULES).unwrap();
    let (mut holds_fd, mut slot) = (-1, 0);
    assert_eq!(unsafe { gpupool_share_hold(&mut holds_fd, &mut slot) }, Status::Ok, "{}", last());
    assert!(holds_fd >= 0 && held(slot));
    let count = gpupool_share_held_count();
    assert!(count >= 1);

    let f = fds(&desc);
    let mut t: *mut c_void = null_mut();
    let st = unsafe { gpupool_ipc_open_dlpack(desc.as_ptr().cast(), desc.len(), d, f.as_ptr(), f.len(), holds_fd, slot, &mut t) };
    assert_eq!(st, Status::Ok, "{}", last());
    let head = t.cast::<DlTensorHead>();
    let (data, size) = unsafe { ((*head).data, *(*head).shape) };
    assert_eq!(unsafe { ((*head).device_type, (*head).ndim, (*head).dtype) }, (1, 1, [1, 8, 1, 0]), "host memory, 1-D uint8");
    assert_eq!(size, 4096);
    assert_ne!(data, b, "mapped at an address of its own");
    assert_eq!(unsafe { std::slice::from_raw_parts(data.cast::<u8>(), 7) }, b"shared!");
    unsafe { std::ptr::copy_nonoverlapping(b"written".as_ptr(), data.cast::<u8>(), 7) };
    assert_eq!(unsafe { std::slice::from_raw_parts(b.cast::<u8>(), 7) }, b"written", "one memory");
    assert!(held(slot), "held while the tensor lives");

    // The framework drops its last tensor: the deleter closes the import and lets go.
    unsafe { ((*head).deleter.unwrap())(head) };
    assert!(!held(slot), "released by the deleter");
    assert_eq!(gpupool_ipc_close(data, d), Status::InvalidPointer, "the deleter closed the import");

    // A second send of a block the importer already has open is released at once.
    let (mut fd2, mut slot2) = (-1, 0);
    assert_eq!(unsafe { gpupool_share_hold(&mut fd2, &mut slot2) }, Status::Ok);
    assert_eq!(fd2, holds_fd, "one holds file per process");
    assert_eq!(gpupool_share_release(fd2, slot2), Status::Ok, "{}", last());
    assert!(!held(slot2));
    assert_eq!(gpupool_share_release(-1, 0), Status::InvalidArgument);

    // A failed open takes no hold-file mapping's slot and leaves nothing open.
    let mut bad = desc.clone();
    bad[0] ^= 0xff;
    let st = unsafe { gpupool_ipc_open_dlpack(bad.as_ptr().cast(), bad.len(), d, f.as_ptr(), f.len(), -1, 0, &mut t) };
    assert_ne!(st, Status::Ok);
    assert!(t.is_null());
    let st = unsafe { gpupool_ipc_open_dlpack(desc.as_ptr().cast(), desc.len(), d, null_mut(), 0, -1, 0, &mut t) };
    assert_eq!(st, Status::InvalidArgument, "an arena block needs its granules' descriptors");
    assert!(last().contains("0 descriptors passed for a block of 1 granules"), "{}", last());
    // A sender's count to give back: refused without a tensor, a name, or a word offset.
    let name = b"/gpupool-no-such-count";
    assert_eq!(unsafe { gpupool_dlpack_give_back_count(null_mut(), name.as_ptr().cast(), name.len(), 64) }, Status::NullArgument);
    let t = open(&desc, d).cast::<c_void>();
    assert_eq!(unsafe { gpupool_dlpack_give_back_count(t, std::ptr::null(), 0, 64) }, Status::NullArgument);
    assert_eq!(unsafe { gpupool_dlpack_give_back_count(t, name.as_ptr().cast(), name.len(), 63) }, Status::InvalidArgument);
    assert_eq!(unsafe { gpupool_dlpack_give_back_count(t, b"/a\0b".as_ptr().cast(), 4, 64) }, Status::InvalidArgument);
    // A count whose object is gone (its sender ended) is nothing to give back: no warning, closed.
    assert_eq!(unsafe { gpupool_dlpack_give_back_count(t, name.as_ptr().cast(), name.len(), 64) }, Status::Ok);
    let before = imports(d);
    unsafe { ((*t.cast::<DlTensorHead>()).deleter.expect("a deleter"))(t.cast()) };
    assert_eq!(imports(d), before - 1);
    for p in [a, b] {
        assert_eq!(unsafe { gpupool_free(p, d, null_mut()) }, Status::Ok, "{}", last());
    }
}

fn imports(d: i32) -> usize {
    let j = common::device_json(d);
    let at = j.find("\"ipc_imports\":").expect("ipc_imports in the report") + 14;
    j[at..].split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
}

fn open(desc: &[u8], d: i32) -> *mut DlTensorHead {
    let f = fds(desc);
    let mut t: *mut c_void = null_mut();
    let st = unsafe { gpupool_ipc_open_dlpack(desc.as_ptr().cast(), desc.len(), d, f.as_ptr(), f.len(), -1, 0, &mut t) };
    assert_eq!(st, Status::Ok, "{}", last());
    t.cast()
}

#[test]
fn blocks_of_one_granule_share_its_mapping_until_the_last_goes() {
    let d = 62;
    common::host_device_256mib(d, c"arena");
    let (a, b) = (malloc(4096, d), malloc(8192, d));
    let big = malloc(5 << 20, d);
    unsafe {
        std::ptr::copy_nonoverlapping(b"AAAA".as_ptr(), a.cast::<u8>(), 4);
        std::ptr::copy_nonoverlapping(b"BBBB".as_ptr(), b.cast::<u8>(), 4);
    }
    let (da, db, dbig) = (export(a, GPUPOOL_IPC_SHARE_GRANULES).unwrap(), export(b, GPUPOOL_IPC_SHARE_GRANULES).unwrap(), export(big, 0).unwrap());
    // Held, as the framework routes open them: a's hold keeps the granule a and b share.
    let (ta, tb) = (open_held(&da, d, &fds(&da)).unwrap().0, open_held(&db, d, &fds(&db)).unwrap().0);
    assert_eq!(imports(d), 1, "the second block of the granule maps nothing");
    let (pa, pb) = unsafe { ((*ta).data as usize, (*tb).data as usize) };
    assert_eq!(pb - pa, b as usize - a as usize, "laid out as in the exporter");
    assert_eq!(unsafe { std::slice::from_raw_parts(pb as *const u8, 4) }, b"BBBB");
    // A block of several granules is an import of its own.
    let tbig = open_held(&dbig, d, &fds(&dbig)).unwrap().0;
    assert_eq!(imports(d), 2);
    unsafe { ((*tbig).deleter.unwrap())(tbig) };
    assert_eq!(imports(d), 1);
    // The granule stays mapped while a tensor over it lives.
    unsafe { ((*ta).deleter.unwrap())(ta) };
    assert_eq!(imports(d), 1);
    assert_eq!(unsafe { std::slice::from_raw_parts(pb as *const u8, 4) }, b"BBBB", "still mapped for b");
    unsafe { ((*tb).deleter.unwrap())(tb) };
    assert_eq!(imports(d), 0, "closed with the last");
    // Opened again later: a fresh import.
    let again = open_held(&da, d, &fds(&da)).unwrap().0;
    assert_eq!((imports(d), unsafe { std::slice::from_raw_parts((*again).data as *const u8, 4) }), (1, &b"AAAA"[..]));
    unsafe { ((*again).deleter.unwrap())(again) };
    for p in [a, b, big] {
        assert_eq!(unsafe { gpupool_free(p, d, null_mut()) }, Status::Ok, "{}", last());
    }
}

fn open_held(desc: &[u8], d: i32, f: &[i32]) -> Result<(*mut DlTensorHead, u32), String> {
    let (mut holds_fd, mut slot) = (-1, 0);
    assert_eq!(unsafe { gpupool_share_hold(&mut holds_fd, &mut slot) }, Status::Ok, "{}", last());
    let mut t: *mut c_void = null_mut();
    match unsafe { gpupool_ipc_open_dlpack(desc.as_ptr().cast(), desc.len(), d, f.as_ptr(), f.len(), holds_fd, slot, &mut t) } {
        Status::Ok => Ok((t.cast(), slot)),
        _ => {
            let e = last();
            assert_eq!(gpupool_share_release(holds_fd, slot), Status::Ok);
            Err(e)
        }
    }
}

fn open_held_with(desc: &[u8], d: i32, f: &[i32], holds_fd: i32, slot: u32) -> *mut DlTensorHead {
    let mut t: *mut c_void = null_mut();
    let st = unsafe { gpupool_ipc_open_dlpack(desc.as_ptr().cast(), desc.len(), d, f.as_ptr(), f.len(), holds_fd, slot, &mut t) };
    assert_eq!(st, Status::Ok, "{}", last());
    t.cast()
}

fn drop_tensor(t: *mut DlTensorHead) {
    unsafe { ((*t).deleter.unwrap())(t) };
}

/// 64 MiB of new memory (two chunks of 32 MiB), freed; then x takes the first chunk and half
/// the second, y the rest of the second.
fn chunk_layout(d: i32) -> (*mut c_void, *mut c_void) {
    common::host_device_256mib(d, c"arena");
    const MIB: usize = 1 << 20;
    let big = malloc(64 * MIB, d);
    assert_eq!(unsafe { gpupool_free(big, d, null_mut()) }, Status::Ok);
    let (x, y) = (malloc(48 * MIB, d), malloc(8 * MIB, d));
    assert_eq!((x, y as usize - x as usize), (big, 48 * MIB), "the layout these tests rely on");
    (x, y)
}

#[test]
fn a_held_block_inside_a_mapped_span_shares_it_and_the_span_keeps_its_holds() {
    let d = 60;
    let (x, y) = chunk_layout(d);
    unsafe { std::ptr::copy_nonoverlapping(b"YYYY".as_ptr(), y.cast::<u8>(), 4) };
    let (dx, dy) = (export(x, GPUPOOL_IPC_SHARE_GRANULES).unwrap(), export(y, GPUPOOL_IPC_SHARE_GRANULES).unwrap());
    let (tx, hx) = open_held(&dx, d, &fds(&dx)).unwrap();
    assert_eq!(imports(d), 1);
    // y's chunk is part of x's span: no second import.
    let (ty, hy) = open_held(&dy, d, &fds(&dy)).unwrap();
    assert_eq!(imports(d), 1, "y lies inside x's span");
    let (px, py) = unsafe { ((*tx).data as usize, (*ty).data as usize) };
    assert_eq!(py - px, 48 * (1 << 20), "laid out as in the exporter");
    assert_eq!(unsafe { std::slice::from_raw_parts(py as *const u8, 4) }, b"YYYY");
    // Through the span, the descriptors are checked as an import checks them.
    for (what, f) in [("none", vec![]), ("a stranger's", vec![0; fds(&dy).len()])] {
        let e = open_held(&dy, d, &f).map(|(t, _)| drop_tensor(t)).unwrap_err();
        assert!(e.contains("descriptors passed") || e.contains("not the file the exporter shared"), "{what}: {e}");
    }
    // x's tensor goes while y keeps the span: x's hold stays (the exporter keeps x, whose
    // first chunk the span still shows) until the span's last tensor goes.
    drop_tensor(tx);
    assert!(held(hx), "x's hold is kept while its span is mapped");
    assert_eq!(imports(d), 1, "still mapped for y");
    // No tensor here lies in the first chunk now: x opened again is an import of its own.
    let (again, ha) = open_held(&dx, d, &fds(&dx)).unwrap();
    assert_eq!(imports(d), 2, "a chunk no held tensor lies in is not shown through the old span");
    drop_tensor(again);
    assert!(!held(ha));
    drop_tensor(ty);
    assert!(!held(hx) && !held(hy), "the span's holds go with it");
    assert_eq!(imports(d), 0, "closed with the last");
    for p in [x, y] {
        assert_eq!(unsafe { gpupool_free(p, d, null_mut()) }, Status::Ok, "{}", last());
    }
}

#[test]
fn without_holds_a_block_shares_only_a_span_of_exactly_its_own_allocations() {
    let d = 59;
    let (x, y) = chunk_layout(d);
    let (dx, dy) = (export(x, GPUPOOL_IPC_SHARE_GRANULES).unwrap(), export(y, GPUPOOL_IPC_SHARE_GRANULES).unwrap());
    // Nothing keeps x in the exporter once its tensor goes, so y must not keep x's first
    // chunk mapped here: y is an import of its own; and nothing says a span's allocations
    // are still the ones a later descriptor names, so y again is one more.
    let tx = open(&dx, d);
    let ty = open(&dy, d);
    assert_eq!(imports(d), 2);
    let ty2 = open(&dy, d);
    assert_eq!(imports(d), 3, "y again: an import of its own");
    drop_tensor(tx);
    assert_eq!(imports(d), 2, "x's import closed with x's tensor");
    drop_tensor(ty);
    drop_tensor(ty2);
    assert_eq!(imports(d), 0);
    for p in [x, y] {
        assert_eq!(unsafe { gpupool_free(p, d, null_mut()) }, Status::Ok, "{}", last());
    }
}

/// Open `descs` (each with a hold of this process and its descriptors) ahead: the batch
/// and each send's holds file and slot.
fn open_ahead(descs: &[Vec<u8>], f: &[Vec<i32>], d: i32) -> (*mut c_void, Vec<i32>, Vec<u32>) {
    let n = descs.len();
    let (mut holds, mut slots) = (vec![-1; n], vec![0u32; n]);
    for i in 0..n {
        assert_eq!(unsafe { gpupool_share_hold(&mut holds[i], &mut slots[i]) }, Status::Ok, "{}", last());
    }
    let bytes: Vec<u8> = descs.concat();
    let lens: Vec<usize> = descs.iter().map(|x| x.len()).collect();
    let flat: Vec<i32> = (0..n).flat_map(|i| std::iter::once(holds[i]).chain(f[i].iter().copied())).collect();
    let counts: Vec<usize> = f.iter().map(|x| 1 + x.len()).collect();
    let mut batch = null_mut();
    let st = unsafe {
        gpupool_share_open_ahead(n, bytes.as_ptr().cast(), lens.as_ptr(), vec![d; n].as_ptr(), slots.as_ptr(), flat.as_ptr(), counts.as_ptr(), &mut batch)
    };
    assert_eq!(st, Status::Ok, "{}", last());
    assert!(!batch.is_null());
    (batch, holds, slots)
}

fn take(batch: *mut c_void, i: usize) -> Result<*mut DlTensorHead, (Status, String)> {
    let mut t = null_mut();
    match unsafe { gpupool_share_take_ahead(batch, i, &mut t) } {
        Status::Ok => Ok(t.cast()),
        st => {
            assert!(t.is_null());
            Err((st, last()))
        }
    }
}

#[test]
fn sends_opened_ahead_are_the_imports_an_open_would_make_and_what_none_takes_is_closed() {
    let d = 58;
    common::host_device_256mib(d, c"arena");
    let (a, b, big) = (malloc(4096, d), malloc(8192, d), malloc(5 << 20, d));
    for (p, tag) in [(a, b"AAAA"), (b, b"BBBB"), (big, b"GGGG")] {
        unsafe { std::ptr::copy_nonoverlapping(tag.as_ptr(), p.cast::<u8>(), 4) };
    }
    let g = GPUPOOL_IPC_SHARE_GRANULES;
    let mut bad = export(a, g).unwrap();
    bad[0] ^= 0xff;
    let descs = [export(a, g).unwrap(), export(b, g).unwrap(), bad, export(big, g).unwrap()];
    let f = [fds(&descs[0]), fds(&descs[1]), fds(&descs[0]), fds(&descs[3])];
    let (batch, holds, slots) = open_ahead(&descs, &f, d);
    let ta = take(batch, 0).unwrap();
    assert_eq!(unsafe { std::slice::from_raw_parts((*ta).data as *const u8, 4) }, b"AAAA");
    assert!(take(batch, 0).unwrap().is_null(), "taken once: a second take gets nothing to open");
    let tb = take(batch, 1).unwrap();
    let (pa, pb) = unsafe { ((*ta).data as usize, (*tb).data as usize) };
    assert_eq!(pb - pa, b as usize - a as usize, "b maps through a's span, as an open of its own would");
    let (st, why) = take(batch, 2).unwrap_err();
    assert_ne!(st, Status::Ok, "the refused send says so when taken");
    assert!(!why.is_empty());
    assert_eq!(take(batch, 9).unwrap_err().0, Status::InvalidArgument, "no such send");
    // The message unpickled and nobody took big: whether or not the thread opened it, it
    // is not open after the end, and its send keeps its hold (it may still be opened).
    assert_eq!(unsafe { gpupool_share_end_ahead(batch, 0) }, Status::Ok, "{}", last());
    assert_eq!(imports(d), 1, "only the span of a and b stays");
    assert!(held(slots[3]), "an unpickled message's send not taken stays held");
    let late = open_held_with(&descs[3], d, &f[3], holds[3], slots[3]);
    assert_eq!(unsafe { std::slice::from_raw_parts((*late).data as *const u8, 4) }, b"GGGG", "opened later");
    drop_tensor(late);
    assert!(!held(slots[3]));
    assert!(held(slots[0]) && held(slots[1]), "the taken ones are their tensors'");
    drop_tensor(ta);
    drop_tensor(tb);
    assert_eq!(imports(d), 0);
    assert!(!held(slots[0]) && !held(slots[1]));
    // The refused send's hold stays the caller's (its open never took it).
    assert!(held(slots[2]));
    assert_eq!(gpupool_share_release(holds[2], slots[2]), Status::Ok);

    // A message that failed: every send not taken is let go, opened by the thread or not.
    let again = [export(big, g).unwrap(), export(a, g).unwrap(), export(b, g).unwrap()];
    let f2 = [fds(&again[0]), fds(&again[1]), fds(&again[2])];
    let (batch, _, slots) = open_ahead(&again, &f2, d);
    let tb = take(batch, 2).unwrap();
    assert_eq!(unsafe { gpupool_share_end_ahead(batch, 1) }, Status::Ok, "{}", last());
    assert!(!held(slots[0]), "let go with the failed message");
    // a was mapped through the span b's tensor keeps (or not at all, if the thread stopped
    // before it): its hold goes with that span at the latest, as for any tensor gone from
    // a span that stays.
    assert!(held(slots[2]), "the one taken is its tensor's");
    drop_tensor(tb);
    assert_eq!(imports(d), 0);
    assert!(!held(slots[1]) && !held(slots[2]));

    // Bad input: nothing to write to, arrays missing, no batch.
    let mut out = null_mut();
    let null = std::ptr::null::<c_void>();
    assert_eq!(
        unsafe { gpupool_share_open_ahead(1, null, std::ptr::null(), std::ptr::null(), std::ptr::null(), std::ptr::null(), std::ptr::null(), &mut out) },
        Status::NullArgument
    );
    assert!(out.is_null());
    assert_eq!(
        unsafe { gpupool_share_open_ahead(0, null, std::ptr::null(), std::ptr::null(), std::ptr::null(), std::ptr::null(), std::ptr::null(), null_mut()) },
        Status::NullArgument
    );
    // A send without even its holds file's entry, or descriptors missing behind the counts.
    let (one, dev, slot) = (descs[0].len(), d, 0u32);
    assert_eq!(
        unsafe { gpupool_share_open_ahead(1, descs[0].as_ptr().cast(), &one, &dev, &slot, std::ptr::null(), &0, &mut out) },
        Status::InvalidArgument
    );
    assert_eq!(
        unsafe { gpupool_share_open_ahead(1, descs[0].as_ptr().cast(), &one, &dev, &slot, std::ptr::null(), &2, &mut out) },
        Status::NullArgument
    );
    assert!(out.is_null());
    let mut t = null_mut();
    assert_eq!(unsafe { gpupool_share_take_ahead(null_mut(), 0, &mut t) }, Status::NullArgument);
    assert_eq!(unsafe { gpupool_share_end_ahead(null_mut(), 0) }, Status::Ok, "ending no batch does nothing");
    // An empty batch ends at once.
    let mut empty = null_mut();
    assert_eq!(
        unsafe { gpupool_share_open_ahead(0, null, std::ptr::null(), std::ptr::null(), std::ptr::null(), std::ptr::null(), std::ptr::null(), &mut empty) },
        Status::Ok,
        "{}",
        last()
    );
    assert_eq!(unsafe { gpupool_share_end_ahead(empty, 1) }, Status::Ok);
    for p in [a, b, big] {
        assert_eq!(unsafe { gpupool_free(p, d, null_mut()) }, Status::Ok, "{}", last());
    }
}

#[test]
fn without_holds_a_new_block_at_a_freed_blocks_place_shows_its_own_memory() {
    let d = 57;
    common::host_device_256mib(d, c"arena");
    let n = 4 << 20;
    let x = malloc(n, d);
    unsafe { std::ptr::write_bytes(x.cast::<u8>(), 0x5A, n) };
    let tx = open(&export(x, GPUPOOL_IPC_SHARE_GRANULES).unwrap(), d);
    // The exporter lets x go (nothing holds it), gives its memory back and places z there.
    assert_eq!(unsafe { gpupool_free(x, d, null_mut()) }, Status::Ok, "{}", last());
    let mut released = 0;
    assert_eq!(unsafe { gpupool::ffi::core::gpupool_reclaim(d, &mut released) }, Status::Ok, "{}", last());
    let z = malloc(n, d);
    assert_eq!(z, x, "the case needs z where x was");
    unsafe { std::ptr::write_bytes(z.cast::<u8>(), 0xC3, n) };
    let tz = open(&export(z, GPUPOOL_IPC_SHARE_GRANULES).unwrap(), d);
    let seen = unsafe { std::slice::from_raw_parts((*tz).data as *const u8, n) };
    assert!(seen.iter().all(|&b| b == 0xC3), "z's import shows other memory than z's");
    drop_tensor(tz);
    drop_tensor(tx);
    assert_eq!(unsafe { gpupool_free(z, d, null_mut()) }, Status::Ok, "{}", last());
}

#[test]
fn a_collect_over_many_outstanding_sends_costs_each_send_the_same() {
    // 100,000 sends held, all let go: asking about each once must not scan the slots found
    // released before it (which made such a collect quadratic in the sends outstanding).
    let n = 100_000;
    let mut slots = Vec::with_capacity(n);
    let mut fd = -1;
    for _ in 0..n {
        let mut slot = 0;
        assert_eq!(unsafe { gpupool_share_hold(&mut fd, &mut slot) }, Status::Ok, "{}", last());
        slots.push(slot);
    }
    for &s in &slots {
        assert_eq!(gpupool_share_release(fd, s), Status::Ok, "{}", last());
    }
    let t = std::time::Instant::now();
    assert!(slots.iter().all(|&s| !held(s)), "every send was let go");
    let took = t.elapsed();
    assert!(took < std::time::Duration::from_millis(50), "collecting {n} sends took {took:?}");
    // Each slot found released is free once: asking again is refused.
    let mut h = -1;
    assert_eq!(unsafe { gpupool_share_held(slots[0], &mut h) }, Status::InvalidArgument);
}
