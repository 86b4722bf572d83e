//! The status report for other processes: with `GPUPOOL_STATUS_SOCKET=1` a background
//! thread listens on a Unix socket, `$XDG_RUNTIME_DIR/gpupool-<pid>.sock` (or under `/tmp`),
//! and answers every connection with the status report of every device in use, the text
//! `gpupool_memory_status(-1)` returns. `python -m gpupool status --pid PID` reads it.
//!
//! Why a socket and a thread: a report needs the pool locks, which a signal handler must
//! never take; the thread takes them like any caller, only when asked. It is off unless
//! asked for, and only the same user can connect (the socket is created mode 0600).

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::Once;

static START: Once = Once::new();

/// Where a process's status socket is.
pub fn path_for(pid: u32) -> PathBuf {
    let dir = std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from).filter(|d| d.is_dir()).unwrap_or_else(|| PathBuf::from("/tmp"));
    dir.join(format!("gpupool-{pid}.sock"))
}

extern "C" fn remove_at_exit() {
    let _ = std::fs::remove_file(path_for(std::process::id()));
}

/// Start the listener once per process (when configured); `report` writes the answer. Failures are reported once on
/// stderr and otherwise ignored: the pool works without it.
pub fn start(report: fn() -> String) {
    START.call_once(|| {
        let path = path_for(std::process::id());
        let _ = std::fs::remove_file(&path);
        let listener = match UnixListener::bind(&path) {
            Ok(l) => l,
            Err(e) => {
                crate::error::warn(&format!("gpupool: GPUPOOL_STATUS_SOCKET: cannot listen on {}: {e}", path.display()));
                return;
            }
        };
        let _ = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600));
        // SAFETY: registering a plain extern "C" function.
        unsafe { libc::atexit(remove_at_exit) };
        let spawned = std::thread::Builder::new().name("gpupool-status".into()).spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let report = std::panic::catch_unwind(report).unwrap_or_else(|_| "gpupool: the report failed\n".into());
                // A reader that hung up costs no SIGPIPE; one that stops reading holds the
                // thread about a second for each write that cannot proceed.
                let _ = conn.set_write_timeout(Some(std::time::Duration::from_secs(1)));
                let _ = crate::socket::send_all(&conn, report.as_bytes());
            }
        });
        if let Err(e) = spawned {
            crate::error::warn(&format!("gpupool: GPUPOOL_STATUS_SOCKET: cannot start the listener thread: {e}"));
        }
    });
}
