//! The exporter's record of its live exports (`ExportRecord`), which importers fetching
//! descriptors by pid check (`upstream::shared` says why), and where one export is recorded
//! (`RecordRef`).

use super::shared::{start_time_of, Fd};
use crate::error::{Error, Result};

/// Where a descriptor's export is recorded: the exporter's record descriptor, the slot, the
/// token.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct RecordRef {
    pub fd: i32,
    pub slot: u32,
    pub token: u64,
}

/// This process's record of its live exports: a `memfd` (close-on-exec) holding a header
/// (magic, pid, start time) and one 8-byte token per slot, 0 where free. Importers read it
/// through `pidfd_getfd`. One per process, whatever the device or upstream.
pub struct ExportRecord {
    fd: Fd,
    /// Slot -> the granules (descriptor, offset) its export shares.
    live: Vec<Option<Vec<(i32, u64)>>>,
    free: Vec<u32>,
}

const RECORD_MAGIC: u64 = u64::from_le_bytes(*b"GPPEXREC");
const RECORD_HEADER: usize = 24;
/// Live exports a process may have at once.
pub const RECORD_SLOTS: u32 = 1 << 16;

static RECORD: std::sync::Mutex<Option<ExportRecord>> = std::sync::Mutex::new(None);

impl ExportRecord {
    fn create() -> Result<ExportRecord> {
        let os = |what: &str| Error::InvalidArgument(format!("IPC export: {what} failed: {}", std::io::Error::last_os_error()));
        // SAFETY: a NUL-terminated name; valid flags.
        let fd = unsafe { libc::memfd_create(c"gpupool-exports".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(os("memfd_create"));
        }
        let fd = Fd(fd);
        let len = RECORD_HEADER + 8 * RECORD_SLOTS as usize;
        let pid = std::process::id();
        let mut head = Vec::with_capacity(RECORD_HEADER);
        for v in [RECORD_MAGIC, pid as u64, start_time_of(pid)] {
            head.extend_from_slice(&v.to_le_bytes());
        }
        // SAFETY: our own file; a buffer of the length passed.
        let ok = unsafe { libc::ftruncate(fd.raw(), len as libc::off_t) == 0 && libc::pwrite(fd.raw(), head.as_ptr().cast(), head.len(), 0) == head.len() as isize };
        if !ok {
            return Err(os("writing the export record"));
        }
        Ok(ExportRecord { fd, live: Vec::new(), free: Vec::new() })
    }

    fn write_token(&self, slot: u32, token: u64) -> bool {
        let b = token.to_le_bytes();
        // SAFETY: our own file, an 8-byte buffer.
        unsafe { libc::pwrite(self.fd.raw(), b.as_ptr().cast(), 8, (RECORD_HEADER + 8 * slot as usize) as libc::off_t) == 8 }
    }

    /// Record an export of `granules` (descriptor, offset each); returns where it is.
    pub fn add(granules: &[(i32, u64)]) -> Result<RecordRef> {
        let mut g = RECORD.lock().unwrap_or_else(|e| e.into_inner());
        if g.is_none() {
            *g = Some(ExportRecord::create()?);
        }
        let r = g.as_mut().expect("made above");
        let slot = match r.free.pop() {
            Some(s) => s,
            None if (r.live.len() as u32) < RECORD_SLOTS => {
                r.live.push(None);
                (r.live.len() - 1) as u32
            }
            None => return Err(Error::InvalidArgument(format!("IPC export: {RECORD_SLOTS} exports are live; free some first"))),
        };
        let mut token = 0u64;
        while token == 0 {
            // SAFETY: an 8-byte buffer.
            if unsafe { libc::getrandom((&mut token as *mut u64).cast(), 8, 0) } != 8 {
                r.free.push(slot);
                return Err(Error::InvalidArgument("IPC export: getrandom failed".into()));
            }
        }
        if !r.write_token(slot, token) {
            r.free.push(slot);
            return Err(Error::InvalidArgument("IPC export: writing the export record failed".into()));
        }
        r.live[slot as usize] = Some(granules.to_vec());
        Ok(RecordRef { fd: r.fd.raw(), slot, token })
    }

    /// Export `at` ended (its block was freed): its slot is cleared, so its descriptor can
    /// no longer be fetched from.
    pub fn end(at: RecordRef) {
        let mut g = RECORD.lock().unwrap_or_else(|e| e.into_inner());
        let Some(r) = g.as_mut() else { return };
        let slot = at.slot as usize;
        if r.live.get(slot).is_some_and(|e| e.is_some()) && ExportRecord::token_at(&r.fd, at.slot) == Some(at.token) && r.write_token(at.slot, 0) {
            r.live[slot] = None;
            r.free.push(at.slot);
        }
    }

    /// The granule shared as (`fd`, `offset`) is about to be released (its descriptor
    /// closed, or its memory given back): every export that shares it ends first.
    pub fn granule_released(fd: i32, offset: u64) {
        let mut g = RECORD.lock().unwrap_or_else(|e| e.into_inner());
        let Some(r) = g.as_mut() else { return };
        for slot in 0..r.live.len() {
            if r.live[slot].as_ref().is_some_and(|v| v.contains(&(fd, offset))) {
                // A record the exporter cannot clear would let a stale descriptor through:
                // keep the slot out of use rather than reuse it.
                if r.write_token(slot as u32, 0) {
                    r.live[slot] = None;
                    r.free.push(slot as u32);
                }
            }
        }
    }

    /// An importer's check that `fd` is the record of exporter `pid` started at `start_time`.
    pub(super) fn check(fd: &Fd, pid: u32, start_time: u64) -> Result<()> {
        let mut b = [0u8; RECORD_HEADER];
        // SAFETY: a buffer of the length passed.
        let n = unsafe { libc::pread(fd.raw(), b.as_mut_ptr().cast(), b.len(), 0) };
        let at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        if n != RECORD_HEADER as isize || at(0) != RECORD_MAGIC || at(8) != pid as u64 || at(16) != start_time {
            return Err(Error::InvalidArgument(format!(
                "IPC import: the descriptor's export record is not process {pid}'s (forged or stale descriptor)"
            )));
        }
        Ok(())
    }

    /// The token in `slot` of the record `fd` (None where unreadable).
    pub(super) fn token_at(fd: &Fd, slot: u32) -> Option<u64> {
        if slot >= RECORD_SLOTS {
            return None;
        }
        let mut b = [0u8; 8];
        // SAFETY: an 8-byte buffer.
        let n = unsafe { libc::pread(fd.raw(), b.as_mut_ptr().cast(), 8, (RECORD_HEADER + 8 * slot as usize) as libc::off_t) };
        (n == 8).then(|| u64::from_le_bytes(b))
    }
}
