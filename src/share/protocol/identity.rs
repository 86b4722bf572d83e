//! What names shared memory across processes, below the descriptor format and the export
//! record (both use it): a granule as shared, a file's identity, a process's start time,
//! an owned descriptor, and the digest of a granule list.

use crate::error::{Error, Result};

/// A granule as shared: the exporter's descriptor, the offset of the memory behind it, and
/// the identity of the file it was at export (`FileId::of`; zero until the exporter fills
/// it in).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct SharedGranule {
    pub fd: i32,
    pub offset: u64,
    pub file: FileId,
}

/// A file's identity: its device and inode numbers.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct FileId {
    pub dev: u64,
    pub ino: u64,
}

impl FileId {
    /// The identity of the file `fd` refers to.
    pub fn of(fd: i32) -> Result<FileId> {
        // SAFETY: fstat into a zeroed struct of the type it fills.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd, &mut st) } != 0 {
            return Err(Error::InvalidArgument(format!("IPC: fstat of descriptor {fd} failed: {}", std::io::Error::last_os_error())));
        }
        Ok(FileId { dev: st.st_dev, ino: st.st_ino })
    }
}

/// This process's start time (clock ticks after boot, `/proc/self/stat`'s 22nd field), or 0
/// where it cannot be read.
pub fn start_time_of(pid: u32) -> u64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return 0 };
    // The command name (field 2) is in parentheses and may hold spaces: count after it.
    stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(19)).and_then(|v| v.parse().ok()).unwrap_or(0)
}

/// This process's start time (`start_time_of` its pid), read from `/proc` once per process:
/// every export carries it, and a forked child (another pid) reads its own.
pub fn own_start_time() -> u64 {
    static CACHED: std::sync::Mutex<(u32, u64)> = std::sync::Mutex::new((0, 0));
    let pid = std::process::id();
    let mut c = CACHED.lock().unwrap_or_else(|e| e.into_inner());
    if c.0 != pid || c.1 == 0 {
        *c = (pid, start_time_of(pid));
    }
    c.1
}

/// A file descriptor this process owns, closed when dropped.
#[derive(Debug)]
pub struct Fd(pub(in crate::share::protocol) i32);

impl Fd {
    pub fn raw(&self) -> i32 {
        self.0
    }
}

impl Drop for Fd {
    fn drop(&mut self) {
        // SAFETY: a descriptor this process got from the kernel and owns.
        unsafe { libc::close(self.0) };
    }
}

/// The digest of a granule list as a descriptor carries it (descriptor number, offset and
/// file identity per granule), which the exporter's record keeps beside the export's token
/// (`ExportRecord`): FNV-1a over the fields' little-endian bytes, the same in every build.
pub fn granules_digest(granules: &[SharedGranule]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for g in granules {
        for v in [g.fd as u32 as u64, g.offset, g.file.dev, g.file.ino] {
            for byte in v.to_le_bytes() {
                h = (h ^ byte as u64).wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
    }
    h
}
