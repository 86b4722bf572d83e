//! Sharing where this process may not copy another's descriptors, as in a container under
//! Docker's default seccomp profile (`kcmp`, `pidfd_getfd`, `ptrace` and `process_vm_*`
//! refused with EPERM without CAP_SYS_PTRACE): a filter that refuses them is installed on
//! every thread of this test process first, and imports by pid must still work, through
//! the exporter's handover thread. On the host upstream through the C API: device 1
//! exports, device 2 imports (the host upstream maps this same process's memory as
//! another's).

use gpupool::ffi::ipc::GPUPOOL_IPC_SHARE_GRANULES;
use gpupool::Status;
use std::ptr::null_mut;

mod common;
use common::last_error as last;
use common::MIB;

/// Refuse, with EPERM, the calls Docker's default profile refuses a process without
/// CAP_SYS_PTRACE, on every thread of this process (those started later inherit it).
fn contained() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        const AUDIT_ARCH: u32 = if cfg!(target_arch = "x86_64") { 0xC000_003E } else { 0xC000_00B7 };
        let refused = [libc::SYS_kcmp, libc::SYS_pidfd_getfd, libc::SYS_ptrace, libc::SYS_process_vm_readv, libc::SYS_process_vm_writev];
        let stmt = |code: u16, k: u32| libc::sock_filter { code, jt: 0, jf: 0, k };
        let jump = |k: u32, jt: u8, jf: u8| libc::sock_filter { code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16, jt, jf, k };
        let load = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
        let ret = (libc::BPF_RET | libc::BPF_K) as u16;
        let n = refused.len() as u8;
        let mut prog = vec![stmt(load, 4), jump(AUDIT_ARCH, 0, n + 2), stmt(load, 0)];
        for (i, nr) in refused.iter().enumerate() {
            // Matched: jump to the EPERM return just past the other checks and the allow.
            prog.push(jump(*nr as u32, n - i as u8, 0));
        }
        prog.push(stmt(ret, libc::SECCOMP_RET_ALLOW));
        prog.push(stmt(ret, libc::SECCOMP_RET_ERRNO | libc::EPERM as u32));
        // Unmatched arch: allow (this slot is where the arch check's false branch lands).
        prog.push(stmt(ret, libc::SECCOMP_RET_ALLOW));
        let fprog = libc::sock_fprog { len: prog.len() as u16, filter: prog.as_mut_ptr() };
        unsafe {
            assert_eq!(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 0, "{}", std::io::Error::last_os_error());
            let r = libc::syscall(libc::SYS_seccomp, libc::SECCOMP_SET_MODE_FILTER, libc::SECCOMP_FILTER_FLAG_TSYNC, &fprog);
            assert_eq!(r, 0, "seccomp: {}", std::io::Error::last_os_error());
        }
    });
    // The filter holds: copying one of this very process's descriptors is refused.
    unsafe {
        let pidfd = libc::syscall(libc::SYS_pidfd_open, std::process::id() as libc::c_long, 0);
        assert!(pidfd >= 0, "pidfd_open: {}", std::io::Error::last_os_error());
        let r = libc::syscall(libc::SYS_pidfd_getfd, pidfd, 0 as libc::c_long, 0);
        let e = std::io::Error::last_os_error();
        libc::close(pidfd as i32);
        assert!(r < 0 && e.raw_os_error() == Some(libc::EPERM), "pidfd_getfd is not refused: {r} {e}");
    }
}

/// The tests share this process's export record and handover thread: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn setup() -> std::sync::MutexGuard<'static, ()> {
    let g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    contained();
    common::host_device_256mib(1, c"arena");
    common::host_device_256mib(2, c"arena");
    g
}

use common::{free_on as free, malloc_on as malloc};

fn export(p: usize) -> Vec<u8> {
    common::ipc_export(p, GPUPOOL_IPC_SHARE_GRANULES)
}

use common::{ipc_close as close, ipc_open_by_pid as open};

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

#[test]
fn an_import_by_pid_goes_through_the_exporters_handover_thread_when_pidfd_getfd_is_refused() {
    let _g = setup();
    for size in [4096, 3 * MIB, 70 * MIB] {
        let a = malloc(size, 1);
        unsafe { std::ptr::write_bytes(a as *mut u8, 0x5a, size) };
        let desc = export(a);
        let p = open(&desc, 2).unwrap_or_else(|e| panic!("import of {size} bytes: {e}"));
        let seen = unsafe { std::slice::from_raw_parts(p as *const u8, size) };
        assert!(seen.iter().all(|&b| b == 0x5a), "the importer sees the exporter's bytes");
        // Writes go both ways: the same memory, not a copy.
        unsafe { std::ptr::write_bytes(p as *mut u8, 0xa5, size) };
        assert_eq!(unsafe { *(a as *const u8).add(size - 1) }, 0xa5);
        close(p, 2);
        free(a, 1);
    }
}

#[test]
fn a_stale_descriptor_is_refused_by_the_exporter_and_costs_the_importer_no_descriptor() {
    let _g = setup();
    let a = malloc(3 * MIB, 1);
    let desc = export(a);
    let p = open(&desc, 2).unwrap();
    close(p, 2);
    free(a, 1);
    // Once first: the connection to the exporter's thread is made and kept.
    assert!(open(&desc, 2).is_err());
    let before = open_fds();
    for _ in 0..50 {
        let e = open(&desc, 2).expect_err("a freed block's descriptor");
        assert!(e.contains("no longer exports"), "{e}");
    }
    assert!(open_fds() <= before, "failed imports leave no descriptor open: {} then {before}", open_fds());
}

#[test]
fn the_refusal_is_named_where_the_exporter_has_no_handover_thread() {
    let _g = setup();
    let a = malloc(MIB, 1);
    let mut d = gpupool::share::protocol::GranuleDescriptor::decode(&export(a)).unwrap();
    d.handover = 0;
    let e = open(&d.encode(), 2).expect_err("no route to the descriptors");
    assert!(e.contains("was refused") && e.contains("without a handover socket") && e.contains("pass the descriptors yourself"), "{e}");
    free(a, 1);
}

#[test]
fn a_descriptor_altered_or_naming_a_reused_pid_is_refused_on_the_handed_route_too() {
    let _g = setup();
    let a = malloc(5 * MIB, 1);
    let desc = export(a);
    let d = gpupool::share::protocol::GranuleDescriptor::decode(&desc).unwrap();
    // A granule's memory offset changed: the digest under the export's token no longer matches.
    let mut altered = d.clone();
    altered.granules[0].offset ^= 1 << 21;
    let e = open(&altered.encode(), 2).expect_err("an altered descriptor");
    assert!(e.contains("forged or altered"), "{e}");
    // Another start time: the process holding the pid is not the exporter.
    let reused = gpupool::share::protocol::GranuleDescriptor { start_time: d.start_time + 1, ..d.clone() };
    let e = open(&reused.encode(), 2).expect_err("a reused pid");
    assert!(e.contains("not the exporter"), "{e}");
    // The descriptor as exported still opens.
    let p = open(&desc, 2).unwrap();
    close(p, 2);
    free(a, 1);
}

#[test]
fn a_tag_received_through_the_handover_thread_refuses_to_pause_until_the_receiver_lets_go() {
    use gpupool::ffi::tags::{gpupool_tag_begin, gpupool_tag_end, gpupool_tag_pause, gpupool_tag_resume};
    let _g = setup();
    assert_eq!(unsafe { gpupool_tag_begin(c"contained-weights".as_ptr()) }, Status::Ok, "{}", last());
    let w = malloc(5 * MIB, 1);
    assert_eq!(gpupool_tag_end(), Status::Ok);
    unsafe { std::ptr::write_bytes(w as *mut u8, 0x3c, 5 * MIB) };
    let p = open(&export(w), 2).unwrap_or_else(|e| panic!("import of a tag's block: {e}"));
    let pause = || {
        let mut n = 0;
        let st = unsafe { gpupool_tag_pause(1, c"contained-weights".as_ptr(), null_mut(), 1, &mut n) };
        (st, last())
    };
    // The import came through the handover thread: it is counted all the same.
    let (st, why) = pause();
    assert_eq!(st, Status::Busy, "{why}");
    assert!(why.contains(&format!("{w:#x}")) && why.contains(&format!("process {}", std::process::id())), "{why}");
    close(p, 2);
    let (st, why) = pause();
    assert_eq!(st, Status::Ok, "the receiver let go: {why}");
    let mut n = 0;
    assert_eq!(unsafe { gpupool_tag_resume(1, c"contained-weights".as_ptr(), &mut n) }, Status::Ok, "{}", last());
    assert_eq!(unsafe { *(w as *const u8).add(5 * MIB - 1) }, 0x3c);
    free(w, 1);
}
