//! Bad input at the C boundary: every exported function with null, unknown, misaligned,
//! interior and foreign pointers, double frees (also across threads), absurd sizes, bad
//! devices and ids. Each case must give its documented status and change nothing. The
//! cases are the README's table ("Bad input"): this test renders the table from the cases
//! and fails when README.md differs (`GPUPOOL_BLESS=1 cargo test --test bad_input` rewrites it).

use gpupool::ffi::core::*;
use gpupool::ffi::graph::*;
use gpupool::ffi::pinned::*;
use gpupool::{Stats, Status};
use std::ffi::{c_void, CStr};
use std::ptr::null_mut;

const DEV: i32 = 11; // a host device of its own (tests in this binary share the process)
const OTHER: i32 = 12;

fn malloc(size: usize, device: i32) -> *mut c_void {
    let mut p = null_mut();
    assert_eq!(unsafe { gpupool_malloc(&mut p, size, device, null_mut()) }, Status::Ok);
    p
}

fn stats(device: i32) -> Stats {
    let mut s = Stats { struct_size: std::mem::size_of::<Stats>() as u32, ..Default::default() };
    assert_eq!(unsafe { gpupool_get_stats(device, &mut s) }, Status::Ok);
    s
}

/// What a user can observe of the pool, which a rejected call must not change.
fn observable(device: i32) -> (u64, u64, u64, u64) {
    let s = stats(device);
    (s.used_bytes, s.total_bytes, s.n_live_blocks, s.limit_bytes)
}

struct Case {
    call: &'static str,
    input: &'static str,
    expect: Status,
    /// Only without a CUDA driver (the pinned pool needs one).
    no_driver_only: bool,
    run: Box<dyn Fn() -> Status>,
}

fn case(call: &'static str, input: &'static str, expect: Status, run: impl Fn() -> Status + 'static) -> Case {
    Case { call, input, expect, no_driver_only: false, run: Box::new(run) }
}

fn cases() -> Vec<Case> {
    let live = malloc(1 << 20, DEV) as usize; // stays live through the table
    let other = malloc(4096, OTHER) as usize;
    let foreign = Box::leak(vec![0u8; 4096].into_boxed_slice()).as_mut_ptr() as usize;
    let p = |a: usize| a as *mut c_void;
    let mut v = vec![
        case("gpupool_malloc", "out_ptr NULL", Status::NullArgument, || unsafe { gpupool_malloc(null_mut(), 64, DEV, null_mut()) }),
        case("gpupool_malloc", "size SIZE_MAX", Status::OutOfMemory, || {
            let mut q = null_mut();
            unsafe { gpupool_malloc(&mut q, usize::MAX, DEV, null_mut()) }
        }),
        case("gpupool_malloc", "size 2^62 (beyond the device)", Status::OutOfMemory, || {
            let mut q = null_mut();
            unsafe { gpupool_malloc(&mut q, 1 << 62, DEV, null_mut()) }
        }),
        case("gpupool_malloc", "size 0", Status::Ok, || {
            let mut q = 1 as *mut c_void;
            let st = unsafe { gpupool_malloc(&mut q, 0, DEV, null_mut()) };
            if q.is_null() { st } else { Status::Internal }
        }),
        case("gpupool_malloc", "device -1", Status::InvalidDevice, || {
            let mut q = null_mut();
            unsafe { gpupool_malloc(&mut q, 64, -1, null_mut()) }
        }),
        case("gpupool_malloc", "device 64 (past the last id)", Status::InvalidDevice, || {
            let mut q = null_mut();
            unsafe { gpupool_malloc(&mut q, 64, 64, null_mut()) }
        }),
        case("gpupool_free", "NULL", Status::Ok, || unsafe { gpupool_free(null_mut(), DEV, null_mut()) }),
        case("gpupool_free", "unknown pointer", Status::InvalidPointer, || unsafe { gpupool_free(0x7000_0000 as *mut c_void, DEV, null_mut()) }),
        case("gpupool_free", "interior pointer (block + 256)", Status::InvalidPointer, move || unsafe { gpupool_free(p(live + 256), DEV, null_mut()) }),
        case("gpupool_free", "misaligned pointer (block + 1)", Status::InvalidPointer, move || unsafe { gpupool_free(p(live + 1), DEV, null_mut()) }),
        case("gpupool_free", "foreign pointer (host malloc; on a GPU: cudaMalloc)", Status::InvalidPointer, move || unsafe { gpupool_free(p(foreign), DEV, null_mut()) }),
        case("gpupool_free", "pointer of another device", Status::InvalidArgument, move || unsafe { gpupool_free(p(other), DEV, null_mut()) }),
        case("gpupool_free", "double free", Status::InvalidPointer, || {
            let q = malloc(8192, DEV);
            assert_eq!(unsafe { gpupool_free(q, DEV, null_mut()) }, Status::Ok);
            unsafe { gpupool_free(q, DEV, null_mut()) }
        }),
        case("gpupool_free", "double free, second on another thread", Status::InvalidPointer, || {
            let q = malloc(8192, DEV) as usize;
            assert_eq!(unsafe { gpupool_free(q as *mut c_void, DEV, null_mut()) }, Status::Ok);
            std::thread::spawn(move || unsafe { gpupool_free(q as *mut c_void, DEV, null_mut()) }).join().unwrap()
        }),
        case("gpupool_free", "device -1", Status::InvalidDevice, move || unsafe { gpupool_free(p(live), -1, null_mut()) }),
        case("gpupool_record_stream", "NULL", Status::NullArgument, || unsafe { gpupool_record_stream(null_mut(), null_mut()) }),
        case("gpupool_record_stream", "unknown pointer", Status::InvalidPointer, || unsafe { gpupool_record_stream(0x7000_0000 as *mut c_void, null_mut()) }),
        case("gpupool_get_stats", "out NULL", Status::NullArgument, || unsafe { gpupool_get_stats(DEV, null_mut()) }),
        case("gpupool_get_stats", "device -5", Status::InvalidDevice, || {
            let mut s = Stats::default();
            unsafe { gpupool_get_stats(-5, &mut s) }
        }),
        case("gpupool_reclaim", "device 1000", Status::InvalidDevice, || unsafe { gpupool_reclaim(1000, null_mut()) }),
        case("gpupool_reclaim", "out_released NULL (optional)", Status::Ok, || unsafe { gpupool_reclaim(DEV, null_mut()) }),
        case("gpupool_set_limit_str", "NULL", Status::NullArgument, || unsafe { gpupool_set_limit_str(DEV, std::ptr::null()) }),
        case("gpupool_set_limit_str", "\"lots\"", Status::InvalidArgument, || unsafe { gpupool_set_limit_str(DEV, c"lots".as_ptr()) }),
        case("gpupool_set_limit_str", "\"150%\"", Status::InvalidArgument, || unsafe { gpupool_set_limit_str(DEV, c"150%".as_ptr()) }),
        case("gpupool_set_limit", "SIZE_MAX (beyond the device)", Status::InvalidArgument, || gpupool_set_limit(DEV, usize::MAX)),
        case("gpupool_set_limit_str", "\"4TiB\" (beyond the device)", Status::InvalidArgument, || unsafe { gpupool_set_limit_str(DEV, c"4TiB".as_ptr()) }),
        case("gpupool_get_limit", "out NULL", Status::NullArgument, || unsafe { gpupool_get_limit(DEV, null_mut()) }),
        case("gpupool_configure", "pool \"fancy\"", Status::InvalidArgument, || unsafe { gpupool_configure(OTHER + 1, c"fancy".as_ptr(), null_mut()) }),
        case("gpupool_configure", "upstream \"tpu\"", Status::InvalidArgument, || unsafe { gpupool_configure(OTHER + 1, null_mut(), c"tpu".as_ptr()) }),
        case("gpupool_configure", "device with live allocations", Status::Busy, || unsafe { gpupool_configure(DEV, c"binned".as_ptr(), null_mut()) }),
        case("gpupool_begin_allocate_to_pool", "device -1", Status::InvalidDevice, || unsafe { gpupool_begin_allocate_to_pool(-1, 1, null_mut()) }),
        case("gpupool_end_allocate_to_pool", "pool never begun", Status::InvalidArgument, || gpupool_end_allocate_to_pool(DEV, 12345)),
        case("gpupool_release_pool", "pool never begun", Status::Ok, || gpupool_release_pool(DEV, 12345)),
        case("gpupool_release_capture", "capture id 0", Status::InvalidArgument, || gpupool_release_capture(DEV, 0)),
    ];
    let mut no_driver = vec![
        case("gpupool_pinned_malloc", "any (no CUDA driver)", Status::NoDriver, || {
            let mut q = null_mut();
            unsafe { gpupool_pinned_malloc(&mut q, 64, null_mut()) }
        }),
        case("gpupool_device_count", "any (no CUDA driver)", Status::NoDriver, || {
            let mut n = 0;
            unsafe { gpupool_device_count(&mut n) }
        }),
    ];
    for c in &mut no_driver {
        c.no_driver_only = true;
    }
    v.append(&mut no_driver);
    v
}

fn name(s: Status) -> String {
    format!("`GPUPOOL_STATUS_{}`", format!("{s:?}").chars().fold(String::new(), |mut acc, c| {
        if c.is_uppercase() && !acc.is_empty() {
            acc.push('_');
        }
        acc.push(c.to_ascii_uppercase());
        acc
    }))
}

const BEGIN: &str = "<!-- bad-input-table: generated by tests/bad_input.rs -->";
const END: &str = "<!-- /bad-input-table -->";

#[test]
fn every_bad_input_gets_its_status_changes_nothing_and_the_readme_lists_it() {
    for d in [DEV, OTHER] {
        assert_eq!(unsafe { gpupool_configure(d, c"split".as_ptr(), c"host".as_ptr()) }, Status::Ok);
    }
    let cases = cases();
    let mut n = 0usize;
    let mut count = 0;
    let has_driver = unsafe { gpupool_device_count(&mut count) } == Status::Ok;
    for c in &cases {
        if c.no_driver_only && has_driver {
            continue;
        }
        let before = observable(DEV);
        let got = (c.run)();
        assert_eq!(got, c.expect, "{}({}): got {got:?}", c.call, c.input);
        if got != Status::Ok {
            let n_err = unsafe { gpupool_last_error(null_mut(), 0) };
            let mut buf = vec![0u8; n_err + 1];
            unsafe { gpupool_last_error(buf.as_mut_ptr() as *mut std::ffi::c_char, buf.len()) };
            let msg = CStr::from_bytes_until_nul(&buf).unwrap().to_str().unwrap();
            // Out of memory starts with PyTorch's phrase, which batch-size finders match,
            // then gpupool's report; every other message with gpupool's name.
            let own = if got == Status::OutOfMemory { msg.strip_prefix("CUDA out of memory. ") } else { Some(msg) };
            assert!(own.is_some_and(|m| m.starts_with("gpupool: ")), "{}({}): message {msg:?}", c.call, c.input);
        }
        assert_eq!(observable(DEV), before, "{}({}) changed the pool", c.call, c.input);
        n += 1;
    }
    println!("{n} bad inputs tried");
    let mut table = format!("{BEGIN}\n| call | input | status |\n|---|---|---|\n");
    for c in &cases {
        table.push_str(&format!("| `{}` | {} | {} |\n", c.call, c.input, name(c.expect)));
    }
    table.push_str(END);
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md");
    let readme = std::fs::read_to_string(&path).unwrap();
    let current = match (readme.find(BEGIN), readme.find(END)) {
        (Some(a), Some(b)) => &readme[a..b + END.len()],
        _ => "",
    };
    if std::env::var_os("GPUPOOL_BLESS").is_some() && !current.is_empty() {
        std::fs::write(&path, readme.replace(current, &table)).unwrap();
    } else {
        assert_eq!(current, table, "README.md's bad-input table is stale: `GPUPOOL_BLESS=1 cargo test --test bad_input`");
    }
}
