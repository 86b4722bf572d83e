// Experiment (not committed): consumer address space for share_check's pattern on the host arena.
use gpupool::ffi::core::{gpupool_free, gpupool_malloc};
use gpupool::ffi::ipc::{gpupool_ipc_descriptor_fds, gpupool_ipc_export_flags, GPUPOOL_IPC_SHARE_GRANULES};
use gpupool::ffi::share::gpupool_ipc_open_dlpack;
use gpupool::Status;
use std::ffi::c_void;
use std::ptr::null_mut;
mod common;
use common::last_error as last;

fn malloc(size: usize, d: i32) -> *mut c_void {
    let mut p = null_mut();
    assert_eq!(unsafe { gpupool_malloc(&mut p, size, d, null_mut()) }, Status::Ok, "{}", last());
    p
}
fn free(p: *mut c_void, d: i32) { assert_eq!(unsafe { gpupool_free(p, d, null_mut()) }, Status::Ok); }
fn num(j: &str, k: &str) -> usize {
    let at = j.find(k).unwrap() + k.len();
    j[at..].split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
}

#[test]
fn share_va() {
    let d = 5;
    std::env::set_var("GPUPOOL_HOST_CAPACITY", "80GiB");
    assert_eq!(unsafe { gpupool::ffi::core::gpupool_configure(d, c"arena".as_ptr(), c"host".as_ptr()) }, Status::Ok, "{}", last());
    let n: usize = std::env::var("N").ok().and_then(|v| v.parse().ok()).unwrap_or(1000);
    let maxb: f64 = std::env::var("MAXMIB").ok().and_then(|v| v.parse::<f64>().ok()).unwrap_or(64.0) * 1048576.0;
    let mut x: u64 = 1234;
    let mut rnd = || { x ^= x << 13; x ^= x >> 7; x ^= x << 17; (x >> 11) as f64 / (1u64 << 53) as f64 };
    let sizes = [4usize, 2, 1, 8];
    let mut finals = Vec::new();
    let mut in_granules = 0;
    for i in 0..n {
        let es = sizes[i % 4];
        let nbytes = (256f64.ln() + rnd() * (maxb.ln() - 256f64.ln())).exp() as usize;
        let e = (nbytes / es).max(8);
        let t1 = malloc(8 * e, d);
        let t2 = malloc(8 * e, d); free(t1, d);
        let t3 = malloc(8 * e, d); free(t2, d);
        let t4 = malloc(8 * e, d); free(t3, d);
        let f = malloc(e * es, d); free(t4, d);
        in_granules += (e * es).div_ceil(2 << 20) * (2 << 20);
        finals.push(f);
    }
    let mut opened = 0;
    let mut desc_granules = 0;
    for &f in &finals {
        let mut desc = vec![0u8; 1 << 16];
        let mut len = 0;
        let st = unsafe { gpupool_ipc_export_flags(f, GPUPOOL_IPC_SHARE_GRANULES, desc.as_mut_ptr().cast(), desc.len(), &mut len) };
        assert_eq!(st, Status::Ok, "{}", last());
        let mut fds = vec![0i32; 4096];
        let mut nf = 0;
        assert_eq!(unsafe { gpupool_ipc_descriptor_fds(desc.as_ptr().cast(), len, fds.as_mut_ptr(), fds.len(), &mut nf) }, Status::Ok);
        desc_granules += nf;
        let mut t: *mut c_void = null_mut();
        let st = unsafe { gpupool_ipc_open_dlpack(desc.as_ptr().cast(), len, d, fds.as_ptr(), nf, -1, 0, &mut t) };
        assert_eq!(st, Status::Ok, "{}", last());
        opened += 1;

    }
    let j = common::device_json(d);
    let va = num(&j, "\"ipc_import_address_space\":");
    eprintln!("opened {opened} imports {} va {:.2} GiB in_granules {:.2} GiB ratio {:.2} fds {} mapped {:.2} GiB",
        num(&j, "\"ipc_imports\":"), va as f64 / (1u64 << 30) as f64, in_granules as f64 / (1u64 << 30) as f64,
        va as f64 / in_granules as f64, desc_granules, num(&j, "\"total_bytes\":") as f64 / (1u64 << 30) as f64);
}
