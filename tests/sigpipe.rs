//! Peers of the library's sockets that hang up. A handover taker whose kept connection the
//! sender closed sends its request again on a new connection (it failed the take before).
//! And a host program whose SIGPIPE is the default (C programs' usually is; Rust's and
//! Python's runtimes ignore it) is not killed by such writes, the status report's to readers
//! that went at once included (`crate::socket`: std writes Unix sockets with `MSG_NOSIGNAL`
//! only from Rust 1.90 on). A binary of its own: a signal's disposition is the whole
//! process's.

use gpupool::ffi::core::{gpupool_configure, gpupool_free, gpupool_malloc};
use gpupool::share::handover::{take, KEY_BYTES};
use std::ffi::c_void;
use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::ptr::null_mut;
use std::time::Duration;

#[test]
fn a_closed_kept_connection_is_retried_and_no_hang_up_kills_a_process_whose_sigpipe_is_default() {
    // SAFETY: setting a disposition; the test harness runs this binary's one test alone.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };

    // The status socket: readers that connect and hang up before their answer is written.
    let dir = std::env::temp_dir().join(format!("gpupool-sigpipe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::env::set_var("XDG_RUNTIME_DIR", &dir);
    std::env::set_var("GPUPOOL_STATUS_SOCKET", "1");
    unsafe {
        assert_eq!(gpupool_configure(0, c"arena".as_ptr(), c"host".as_ptr()), gpupool::Status::Ok);
        let mut p: *mut c_void = null_mut();
        assert_eq!(gpupool_malloc(&mut p, 1 << 20, 0, null_mut()), gpupool::Status::Ok);
        assert_eq!(gpupool_free(p, 0, null_mut()), gpupool::Status::Ok);
    }
    let path = gpupool::status_socket::path_for(std::process::id());
    for _ in 0..50 {
        drop(UnixStream::connect(&path).expect("the status socket listens"));
    }
    // Still alive, and the thread still answers.
    let mut report = String::new();
    UnixStream::connect(&path).unwrap().read_to_string(&mut report).unwrap();
    assert!(report.contains("device 0"), "{report}");

    // A sender (played here) that answers one request on a connection, then closes it: the
    // taker keeps the connection, and its next request goes to a closed peer. It is sent
    // again on a new connection, which this sender answers too.
    let name = format!("gpupool-sigpipe-test-{}", std::process::id()).into_bytes();
    let listener = UnixListener::bind_addr(&SocketAddr::from_abstract_name(&name).unwrap()).unwrap();
    let (closed, closed_rx) = std::sync::mpsc::channel();
    let sender = std::thread::spawn(move || {
        let mut served = 0;
        for conn in listener.incoming().take(2) {
            let mut conn = conn.unwrap();
            let mut key = [0u8; KEY_BYTES];
            conn.read_exact(&mut key).unwrap();
            conn.write_all(&[1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]).unwrap(); // UNKNOWN
            served += 1;
            drop(conn);
            let _ = closed.send(());
        }
        served
    });
    let mut ticket = vec![7u8; KEY_BYTES];
    ticket.extend_from_slice(&name);
    let first = take(&ticket).unwrap_err().to_string();
    assert!(first.contains("no such handover"), "{first}");
    closed_rx.recv_timeout(Duration::from_secs(10)).expect("the sender closed its side");
    let second = take(&ticket).unwrap_err().to_string();
    assert!(second.contains("no such handover"), "retried on a new connection: {second}");
    assert_eq!(sender.join().unwrap(), 2);
    let _ = std::fs::remove_dir_all(&dir);
}
