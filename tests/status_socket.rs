//! The status socket's place (Note [The status socket]): a directory private to the user,
//! refused where another user could have prepared it, and a socket closed to others from
//! the moment it listens.

use gpupool::status_socket::{listen_in, private_directory};
use std::io::Read;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("gpupool-status-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn a_missing_directory_is_made_private_and_the_socket_is_the_users_alone() {
    let root = scratch("fresh");
    let dir = root.join("gpupool");
    let listener = listen_in(&dir, 4242).expect("a fresh place");
    let m = std::fs::metadata(&dir).unwrap();
    assert_eq!(m.mode() & 0o777, 0o700);
    let sock = dir.join("4242.sock");
    assert_eq!(std::fs::metadata(&sock).unwrap().mode() & 0o777, 0o600);
    let mut c = UnixStream::connect(&sock).expect("it listens");
    let (mut s, _) = listener.accept().unwrap();
    use std::io::Write;
    s.write_all(b"report").unwrap();
    drop(s);
    let mut got = String::new();
    c.read_to_string(&mut got).unwrap();
    assert_eq!(got, "report");
    // A socket an earlier process of the same pid left is replaced, not an error.
    drop(listener);
    listen_in(&dir, 4242).expect("a stale socket of this user is replaced");
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn a_directory_open_to_others_a_link_or_another_users_is_refused_and_nothing_listens() {
    let root = scratch("refused");
    let open = root.join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let e = listen_in(&open, 1).unwrap_err();
    assert!(e.contains("open to other users (mode 777)"), "{e}");
    assert!(!open.join("1.sock").exists());

    let target = root.join("elsewhere");
    std::fs::create_dir(&target).unwrap();
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o700)).unwrap();
    let link = root.join("link");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let e = listen_in(&link, 1).unwrap_err();
    assert!(e.contains("is not a directory (a link or a file is there)"), "{e}");
    assert!(!target.join("1.sock").exists());

    // Another user's directory: making one takes root (chown); as another user the first
    // two cases cover the same check's other branches.
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        let theirs = root.join("theirs");
        std::fs::create_dir(&theirs).unwrap();
        std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
        let e = private_directory(&theirs).unwrap_err();
        assert!(e.contains("belongs to uid 65534, not to this user (uid 0)"), "{e}");
        assert!(listen_in(&theirs, 1).is_err());
        assert!(!theirs.join("1.sock").exists());
    } else {
        eprintln!("another user's directory: not checked (needs root to chown)");
    }
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn xdg_runtime_dir_is_used_only_where_it_is_the_users_own_and_closed_to_others() {
    use gpupool::status_socket::directory_of;
    // SAFETY: geteuid cannot fail.
    let me = unsafe { libc::geteuid() };
    let root = scratch("xdg");
    let mine = root.join("mine");
    std::fs::create_dir(&mine).unwrap();
    std::fs::set_permissions(&mine, std::fs::Permissions::from_mode(0o700)).unwrap();
    // The one test of this binary that sets the variable; the others never read it.
    std::env::set_var("XDG_RUNTIME_DIR", &mine);
    assert_eq!(directory_of(me), mine.join("gpupool"));
    // A shared, world-writable directory (some images set XDG_RUNTIME_DIR=/tmp).
    std::fs::set_permissions(&mine, std::fs::Permissions::from_mode(0o1777)).unwrap();
    assert_eq!(directory_of(me), PathBuf::from(format!("/tmp/gpupool-{me}")));
    // Another user's (`su` and `sudo -E` keep it): theirs is not ours to fill.
    std::fs::set_permissions(&mine, std::fs::Permissions::from_mode(0o700)).unwrap();
    assert_eq!(directory_of(me + 1), PathBuf::from(format!("/tmp/gpupool-{}", me + 1)));
    std::env::set_var("XDG_RUNTIME_DIR", "relative/dir");
    assert_eq!(directory_of(me), PathBuf::from(format!("/tmp/gpupool-{me}")));
    std::env::remove_var("XDG_RUNTIME_DIR");
    std::fs::remove_dir_all(&root).unwrap();
}
