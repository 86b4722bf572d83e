//! The status report for other processes: with `GPUPOOL_STATUS_SOCKET=1` a background
//! thread listens on a Unix socket and answers every connection from the same user with the
//! status report of every device in use, the text `gpupool_memory_status(-1)` returns.
//! `python -m gpupool status --pid PID` reads it.
//!
//! Note [The status socket]
//!
//! Rationale: a report needs the pool locks, which a signal handler must never take; a
//! thread takes them like any caller, only when asked. It is off unless asked for. The
//! report names tags, sizes and call sites, so it is for the process's own user alone, and
//! nobody else may stand in for the process: a reader trusts what the socket says.
//!
//! Approach: the socket lives in a directory private to the user, `$XDG_RUNTIME_DIR/gpupool`
//! (systemd makes `XDG_RUNTIME_DIR` per user, mode 0700; used only when it is the user's
//! and closed to others' writes) or else `/tmp/gpupool-<uid>`, as `<pid>.sock`. A name under `/tmp` can be taken first by anyone, so the directory is
//! used only when it is a real directory (no link), owned by this user and closed to
//! everyone else; otherwise the listener does not start and says why. Both ends check the
//! other's kernel-reported credentials (`SO_PEERCRED`): the server answers only its own
//! user (and root, who can read the process's memory anyway), the reader accepts an answer
//! only from the process it asked for, of its own user.
//!
//! Implementation: the socket is bound, made mode 0600 and only then put to listening, so
//! there is no moment at which another user can connect. `gpupool_status_socket_path`
//! gives the path to readers in other languages, so the rule lives here alone.
//!
//! Limitations: a reader in another PID namespace (another container) sees other pid
//! numbers and is refused; it can read the report with `gpupool_memory_status` inside.

use std::os::fd::OwnedFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Once;

static START: Once = Once::new();

fn euid() -> u32 {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() }
}

/// The directory that holds the status sockets of user `uid`'s processes (not checked;
/// see `private_directory`): `$XDG_RUNTIME_DIR/gpupool` where that variable names a directory
/// of `uid`'s that no one else may write (as systemd makes it; `su` and `sudo -E` keep
/// another user's, and some images set it to `/tmp`), else `/tmp/gpupool-<uid>`.
pub fn directory_of(uid: u32) -> PathBuf {
    let private_runtime_dir = std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from).filter(|d| {
        d.is_absolute() && std::fs::symlink_metadata(d).is_ok_and(|m| m.is_dir() && m.uid() == uid && m.mode() & 0o022 == 0)
    });
    match private_runtime_dir {
        Some(d) => d.join("gpupool"),
        None => PathBuf::from(format!("/tmp/gpupool-{uid}")),
    }
}

/// This user's directory (`directory_of`).
pub fn directory() -> PathBuf {
    directory_of(euid())
}

/// Where process `pid`'s status socket is, for a reader: the place `pid` itself would
/// choose when the reader shares its environment, else the fallback for `pid`'s user (a
/// reader started without `XDG_RUNTIME_DIR`, or root reading another user's process);
/// both ends check each other's credentials, so trying a second place is safe.
pub fn path_for(pid: u32) -> PathBuf {
    let name = format!("{pid}.sock");
    let owner = std::fs::metadata(format!("/proc/{pid}")).map(|m| m.uid()).unwrap_or_else(|_| euid());
    let first = directory_of(owner).join(&name);
    if first.exists() {
        return first;
    }
    let fallback = PathBuf::from(format!("/tmp/gpupool-{owner}")).join(&name);
    if fallback.exists() {
        fallback
    } else {
        first
    }
}

/// `dir`, created mode 0700 where it is missing, once it is known to be a real directory
/// owned by this user that no other user can enter; else why not.
pub fn private_directory(dir: &Path) -> Result<(), String> {
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(format!("cannot create {}: {e}", dir.display())),
    }
    let m = std::fs::symlink_metadata(dir).map_err(|e| format!("cannot inspect {}: {e}", dir.display()))?;
    if !m.file_type().is_dir() {
        return Err(format!("{} is not a directory (a link or a file is there); remove it", dir.display()));
    }
    if m.uid() != euid() {
        return Err(format!(
            "{} belongs to uid {}, not to this user (uid {}): another user may have made it to stand in for this \
             process; remove it, or set XDG_RUNTIME_DIR to a directory of your own",
            dir.display(),
            m.uid(),
            euid()
        ));
    }
    if m.mode() & 0o077 != 0 {
        return Err(format!(
            "{} is open to other users (mode {:o}); make it private (chmod 700) or remove it",
            dir.display(),
            m.mode() & 0o777
        ));
    }
    Ok(())
}

/// A listener on `<dir>/<pid>.sock`, in a private `dir` (see `private_directory`), mode 0600
/// before it listens.
pub fn listen_in(dir: &Path, pid: u32) -> Result<UnixListener, String> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    private_directory(dir)?;
    let path = dir.join(format!("{pid}.sock"));
    let fail = |what: &str, e: &dyn std::fmt::Display| format!("cannot {what} {}: {e}", path.display());
    // A socket left by an earlier process of this pid (the directory is private: it is ours).
    match std::fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(fail("replace", &e)),
    }
    let fd: OwnedFd = rustix::net::socket_with(AddressFamily::UNIX, SocketType::STREAM, SocketFlags::CLOEXEC, None)
        .map_err(|e| fail("create a socket for", &e))?;
    let addr = SocketAddrUnix::new(&path).map_err(|e| fail("use", &e))?;
    rustix::net::bind(&fd, &addr).map_err(|e| fail("bind", &e))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).map_err(|e| fail("restrict", &e))?;
    rustix::net::listen(&fd, 16).map_err(|e| fail("listen on", &e))?;
    Ok(UnixListener::from(fd))
}

/// Whether a connecting process may read the report: the same user, or root.
fn may_read(conn: &UnixStream) -> bool {
    match rustix::net::sockopt::socket_peercred(conn) {
        Ok(c) => {
            let uid = c.uid.as_raw();
            uid == euid() || uid == 0
        }
        Err(_) => false,
    }
}

extern "C" fn remove_at_exit() {
    let _ = std::fs::remove_file(directory().join(format!("{}.sock", std::process::id())));
}

/// Start the listener once per process (when configured); `report` writes the answer. Failures are reported once on
/// stderr and otherwise ignored: the pool works without it.
pub fn start(report: fn() -> String) {
    START.call_once(|| {
        let listener = match listen_in(&directory(), std::process::id()) {
            Ok(l) => l,
            Err(e) => {
                crate::error::warn(&format!("gpupool: GPUPOOL_STATUS_SOCKET: the status socket is off: {e}"));
                return;
            }
        };
        // SAFETY: registering a plain extern "C" function.
        unsafe { libc::atexit(remove_at_exit) };
        let spawned = std::thread::Builder::new().name("gpupool-status".into()).spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                if !may_read(&conn) {
                    continue; // closed unanswered
                }
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
