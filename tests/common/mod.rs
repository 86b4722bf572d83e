//! Helpers shared by the integration tests: pools on the host upstream with the invariant
//! scan on after every operation, and a pattern writer that proves blocks do not overlap.
#![allow(dead_code)]

use gpupool::config::PoolKind;
use gpupool::upstream::host::HostUpstream;
use gpupool::{Pool, PoolOptions};

pub const MIB: usize = 1 << 20;

pub fn host_pool(kind: PoolKind, capacity: usize) -> Pool {
    let opts = PoolOptions { kind, check_invariants: true, ..Default::default() };
    Pool::new(0, Box::new(HostUpstream::new(capacity)), &opts).expect("host pool")
}

/// Fill a host block with a tag derived from its address and id.
pub fn stamp(addr: usize, len: usize, id: u64) {
    let p = addr as *mut u8;
    let tag = (id as u8).wrapping_mul(31).wrapping_add(7);
    // SAFETY: the pool handed us [addr, addr+len) on the host upstream.
    unsafe {
        *p.add(len - 1) = tag ^ 0xff;
        if len > 2 {
            *p.add(len / 2) = tag.wrapping_add(1);
        }
        *p = tag;
    }
}

/// Check the tag written by `stamp` is intact (nobody else wrote into the block).
pub fn intact(addr: usize, len: usize, id: u64) -> bool {
    let p = addr as *const u8;
    let tag = (id as u8).wrapping_mul(31).wrapping_add(7);
    // SAFETY: as in `stamp`.
    unsafe {
        *p == tag && (len == 1 || *p.add(len - 1) == tag ^ 0xff) && (len <= 2 || *p.add(len / 2) == tag.wrapping_add(1))
    }
}

#[allow(unused_macros)] // used by the tests whose upstreams wrap the host one
/// The host upstream's segment calls (`allocate`, `deallocate`, `mem_info`), passed through,
/// for test upstreams that wrap a `HostUpstream` in a field named `host` and change only
/// other calls.
macro_rules! host_memory {
    () => {
        fn allocate(&mut self, size: usize, s: gpupool::stream::StreamHandle) -> std::result::Result<usize, gpupool::upstream::AllocError> {
            self.host.allocate(size, s)
        }
        fn deallocate(&mut self, a: usize, size: usize, s: gpupool::stream::StreamHandle) -> gpupool::error::Result<()> {
            self.host.deallocate(a, size, s)
        }
        fn mem_info(&mut self) -> gpupool::error::Result<(usize, usize)> {
            self.host.mem_info()
        }
    };
}

#[allow(unused_macros)] // used by the tests whose upstreams wrap the host one
/// The address-space half of the host upstream's virtual memory API, for test upstreams
/// that wrap a `HostUpstream` in a field named `host` and override the mapping calls.
macro_rules! host_address_space {
    () => {
        fn vmm_granule(&mut self) -> usize {
            self.host.vmm_granule()
        }
        fn vmm_reserve(&mut self, len: usize) -> gpupool::error::Result<usize> {
            self.host.vmm_reserve(len)
        }
        fn vmm_unreserve(&mut self, base: usize, len: usize) -> gpupool::error::Result<()> {
            self.host.vmm_unreserve(base, len)
        }
    };
}

/// This thread's last detailed gpupool error message, as a C caller reads it.
pub fn last_error() -> String {
    use gpupool::ffi::core::gpupool_last_error;
    let n = unsafe { gpupool_last_error(std::ptr::null_mut(), 0) };
    let mut buf = vec![0u8; n + 1];
    unsafe { gpupool_last_error(buf.as_mut_ptr() as *mut std::ffi::c_char, buf.len()) };
    std::ffi::CStr::from_bytes_until_nul(&buf).unwrap().to_str().unwrap().to_string()
}

/// `device`'s statistics through the C API (the call must succeed).
pub fn device_stats(device: i32) -> gpupool::Stats {
    use gpupool::ffi::core::gpupool_get_stats;
    let mut s = gpupool::Stats { struct_size: std::mem::size_of::<gpupool::Stats>() as u32, ..Default::default() };
    assert_eq!(unsafe { gpupool_get_stats(device, &mut s) }, gpupool::Status::Ok);
    s
}

/// Configure `device` as a `pool` on a simulated host device of 256 MiB. The capacity is
/// read once per process, before the first call, so every caller in a test binary gets it:
/// out-of-memory paths are reachable.
pub fn host_device_256mib(device: i32, pool: &std::ffi::CStr) {
    static ENV: std::sync::Once = std::sync::Once::new();
    ENV.call_once(|| std::env::set_var("GPUPOOL_HOST_CAPACITY", "256MiB"));
    let st = unsafe { gpupool::ffi::core::gpupool_configure(device, pool.as_ptr(), c"host".as_ptr()) };
    assert_eq!(st, gpupool::Status::Ok, "{}", last_error());
}

/// `size` bytes on `device` on the legacy stream, through the C API (asserted to succeed).
pub fn malloc_on(size: usize, device: i32) -> usize {
    let mut p = std::ptr::null_mut();
    let st = unsafe { gpupool::ffi::core::gpupool_malloc(&mut p, size, device, std::ptr::null_mut()) };
    assert_eq!(st, gpupool::Status::Ok, "{}", last_error());
    p as usize
}

/// Free what `malloc_on` gave, through the C API (asserted to succeed).
pub fn free_on(p: usize, device: i32) {
    let st = unsafe { gpupool::ffi::core::gpupool_free(p as *mut std::ffi::c_void, device, std::ptr::null_mut()) };
    assert_eq!(st, gpupool::Status::Ok, "{}", last_error());
}

/// `device`'s statistics as JSON, through the C API.
pub fn device_json(device: i32) -> String {
    use gpupool::ffi::core::gpupool_stats_json;
    let n = unsafe { gpupool_stats_json(device, std::ptr::null_mut(), 0) };
    let mut buf = vec![0u8; n + 1];
    unsafe { gpupool_stats_json(device, buf.as_mut_ptr() as *mut std::ffi::c_char, buf.len()) };
    std::ffi::CStr::from_bytes_until_nul(&buf).unwrap().to_str().unwrap().to_string()
}

/// `device`'s status report, through the C API.
pub fn memory_status(device: i32) -> String {
    use gpupool::ffi::core::gpupool_memory_status;
    let n = unsafe { gpupool_memory_status(device, std::ptr::null_mut(), 0) };
    let mut buf = vec![0u8; n + 1];
    unsafe { gpupool_memory_status(device, buf.as_mut_ptr() as *mut std::ffi::c_char, buf.len()) };
    std::ffi::CStr::from_bytes_until_nul(&buf).unwrap().to_str().unwrap().to_string()
}

/// The IPC descriptor of the live block `p` (`gpupool_ipc_export_flags` with `flags`).
pub fn ipc_export(p: usize, flags: u32) -> Vec<u8> {
    let mut desc = vec![0u8; 1 << 16];
    let mut len = 0;
    let st = unsafe { gpupool::ffi::ipc::gpupool_ipc_export_flags(p as *mut std::ffi::c_void, flags, desc.as_mut_ptr().cast(), desc.len(), &mut len) };
    assert_eq!(st, gpupool::Status::Ok, "{}", last_error());
    desc.truncate(len);
    desc
}

/// Open `desc` on device `d` fetching the exporter's descriptors itself; the error text.
pub fn ipc_open_by_pid(desc: &[u8], d: i32) -> Result<usize, String> {
    let mut p = std::ptr::null_mut();
    match unsafe { gpupool::ffi::ipc::gpupool_ipc_open(desc.as_ptr().cast(), desc.len(), d, std::ptr::null(), 0, &mut p) } {
        gpupool::Status::Ok => Ok(p as usize),
        _ => Err(last_error()),
    }
}

/// Close what `ipc_open_by_pid` opened.
pub fn ipc_close(p: usize, d: i32) {
    assert_eq!(gpupool::ffi::ipc::gpupool_ipc_close(p as *mut std::ffi::c_void, d), gpupool::Status::Ok, "{}", last_error());
}

/// Whether this process may open pidfds and copy descriptors through them (valgrind,
/// kernels before 5.6 and seccomp filters refuse): where it may not, imports by pid go
/// through the sender's handover socket instead.
pub fn pidfd_works() -> bool {
    // SAFETY: plain syscalls; the descriptors they return are closed here.
    unsafe {
        let fd = libc::syscall(libc::SYS_pidfd_open, std::process::id() as libc::c_long, 0);
        if fd < 0 {
            return false;
        }
        let copy = libc::syscall(libc::SYS_pidfd_getfd, fd, fd, 0);
        if copy >= 0 {
            libc::close(copy as i32);
        }
        libc::close(fd as i32);
        copy >= 0
    }
}
