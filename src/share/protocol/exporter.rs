//! How an importer gets an exporter's file descriptors: `Exporter` (a pidfd of the exporting
//! process and its export record, checked to be that process's) and `FdSource` (the
//! caller's own descriptors, or ones fetched by pid one granule at a time), with the checks
//! that a descriptor's export is still live. Note [Sharing between processes] says why
//! each check is there.

use super::granule_descriptor::GranuleDescriptor;
use super::identity::{granules_digest, start_time_of, Fd, FileId, SharedGranule};
use super::open_mark::{Keeper, OpenMark};
use super::record::{ExportRecord, RecordRef};
use crate::error::{Error, Result};

/// An exporter, opened by an importer to fetch descriptors from: a pidfd of the process
/// (which says when it has exited, and fetches its descriptors) and the exporter's record
/// of its exports, checked to be that process's. Kept between imports by the
/// importer's cache (`share::import_cache`), so a message of many blocks opens its exporter
/// once.
#[derive(Debug)]
pub struct Exporter {
    pub pid: u32,
    pub start_time: u64,
    pidfd: Fd,
    record: Fd,
    /// The record's descriptor number in the exporter.
    record_fd: i32,
    /// The identity of the record's file (a memfd: unique while it exists).
    record_file: FileId,
    /// This process as a keeper of idle mappings of the exporter's pausable memory, once
    /// asked (`keeper`): None inside where no entry could be claimed.
    keeper: std::sync::Mutex<Option<Option<std::sync::Arc<Keeper>>>>,
}

impl Exporter {
    /// Open the exporter of `d`: a process holding its pid that started at another time is
    /// not the exporter (refused).
    pub fn open(d: &GranuleDescriptor) -> Result<Exporter> {
        let pid = d.pid;
        // SAFETY: a plain syscall with integer arguments.
        let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        if pidfd < 0 {
            return Err(fetch_error(pid, "pidfd_open"));
        }
        let pidfd = Fd(pidfd as i32);
        // Read after the pidfd pins the process: if it is the exporter, it stays so.
        still_the_exporter(d)?;
        // SAFETY: as above; the result is a new descriptor this process owns.
        let record = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.raw(), d.record.fd, 0) };
        if record < 0 {
            return Err(fetch_error(pid, &format!("pidfd_getfd of its export record (descriptor {})", d.record.fd)));
        }
        let record = Fd(record as i32);
        ExportRecord::check(&record, pid, d.start_time)?;
        let record_file = FileId::of(record.raw())?;
        Ok(Exporter { pid, start_time: d.start_time, pidfd, record, record_fd: d.record.fd, record_file, keeper: Default::default() })
    }

    /// Whether the exporter still holds the record this importer opened: an `exec` keeps
    /// the pid and start time but closes the record (close-on-exec), and a later one may
    /// take its number. `kcmp` compares the two open files; where the kernel refuses it,
    /// the number is fetched again and its file compared.
    pub fn same_record(&self) -> bool {
        const KCMP_FILE: libc::c_long = 0;
        // SAFETY: a plain syscall with integer arguments.
        let r = unsafe {
            libc::syscall(libc::SYS_kcmp, std::process::id() as libc::c_long, self.pid as libc::c_long, KCMP_FILE, self.record.raw() as libc::c_long, self.record_fd as libc::c_long)
        };
        if r >= 0 {
            return r == 0;
        }
        // SAFETY: as in `open`; the result is a new descriptor this process owns.
        let again = unsafe { libc::syscall(libc::SYS_pidfd_getfd, self.pidfd.raw(), self.record_fd, 0) };
        if again < 0 {
            return false;
        }
        let again = Fd(again as i32);
        FileId::of(again.raw()).is_ok_and(|f| f == self.record_file)
    }

    /// Count an open import of export `at` in the exporter's opens file (`OpenMark`).
    pub fn mark_open(&self, at: RecordRef) -> Result<OpenMark> {
        OpenMark::new(self.opens_file()?.raw(), at.slot, self.pid)
    }

    /// This process's copy of the exporter's opens file.
    fn opens_file(&self) -> Result<Fd> {
        let theirs = ExportRecord::opens_fd_at(&self.record)
            .ok_or_else(|| Error::InvalidArgument(format!("IPC import: the export record of process {} cannot be read", self.pid)))?;
        // SAFETY: as in `open`; the result is a new descriptor this process owns.
        let mine = unsafe { libc::syscall(libc::SYS_pidfd_getfd, self.pidfd.raw(), theirs, 0) };
        if mine < 0 {
            return Err(fetch_error(self.pid, &format!("pidfd_getfd of its opens file (descriptor {theirs})")));
        }
        Ok(Fd(mine as i32))
    }

    /// This process as a keeper of idle mappings of the exporter's pausable memory
    /// (`opens_file::Keepers`), claimed on first use; None where it cannot be (every entry
    /// held, or the opens file out of reach): such mappings then go at their last close.
    pub fn keeper(&self) -> Option<std::sync::Arc<Keeper>> {
        let mut k = self.keeper.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = k.as_ref() {
            return k.clone();
        }
        let got = self.opens_file().and_then(|f| Keeper::new(f.raw())).ok().flatten().map(std::sync::Arc::new);
        *k = Some(got.clone());
        got
    }

    /// Whether `d` comes from this exporter (same process, same record).
    pub fn is_of(&self, d: &GranuleDescriptor) -> bool {
        self.pid == d.pid && self.start_time == d.start_time && self.record_fd == d.record.fd
    }

    /// Whether the exporter has exited (its pidfd reads as ready).
    pub fn exited(&self) -> bool {
        let mut p = libc::pollfd { fd: self.pidfd.raw(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one pollfd, no wait.
        unsafe { libc::poll(&mut p, 1, 0) == 1 && p.revents != 0 }
    }

    /// How many exported granules the exporter has released so far (`ExportRecord`); None
    /// where the record cannot be read.
    pub fn releases(&self) -> Option<u64> {
        ExportRecord::releases_at(&self.record)
    }

    /// The exporter still records export `at` of exactly `granules` (else: refused, saying
    /// why).
    pub fn still_exports(&self, at: RecordRef, granules: &[SharedGranule]) -> Result<()> {
        let pid = self.pid;
        match ExportRecord::entry_at(&self.record, at.slot) {
            Some((token, _)) if token != at.token || token == 0 => Err(Error::InvalidArgument(format!(
                "IPC import: process {pid} no longer exports this block (the descriptor is stale: the block was \
                 freed, or its memory released, after the export)"
            ))),
            Some((_, digest)) if digest != granules_digest(granules) => Err(Error::InvalidArgument(format!(
                "IPC import: the descriptor's granules are not the ones process {pid} exported under its token \
                 (a forged or altered descriptor)"
            ))),
            Some(_) => Ok(()),
            None => Err(Error::InvalidArgument(format!("IPC import: the export record of process {pid} cannot be read"))),
        }
    }

    /// This process's copy of the exporter's descriptor `theirs` (granule `i`).
    fn fetch(&self, i: usize, theirs: i32) -> Result<Fd> {
        // SAFETY: as in `open`; the result is a new descriptor this process owns.
        let mine = unsafe { libc::syscall(libc::SYS_pidfd_getfd, self.pidfd.raw(), theirs, 0) };
        if mine < 0 {
            return Err(fetch_error(self.pid, &format!("pidfd_getfd of descriptor {theirs} (granule {i})")));
        }
        Ok(Fd(mine as i32))
    }
}

/// Where an importer's copies of the exporter's descriptors come from.
pub enum FdSource<'a> {
    /// The caller's own, one per granule in the descriptor's order (`GranuleDescriptor::per_granule`
    /// makes them so); they stay the caller's.
    Given(std::borrow::Cow<'a, [i32]>),
    /// Copied out of the exporter (`pidfd_getfd`) one at a time, each closed once its
    /// granule is mapped: the mapping keeps the memory. `at`: this export's slot and token
    /// in the exporter's record, and `granules` the list it recorded.
    Fetch { exporter: std::sync::Arc<Exporter>, at: RecordRef, granules: &'a [SharedGranule] },
}

impl<'a> FdSource<'a> {
    /// The caller's descriptors, one per granule, where they were given.
    pub fn given(&self) -> Option<&[i32]> {
        match self {
            FdSource::Given(fds) => Some(fds),
            FdSource::Fetch { .. } => None,
        }
    }

    /// Open the exporter of `d` to fetch its descriptors from: a process holding its pid
    /// that started at another time is not the exporter, and an export the exporter no
    /// longer records (its block freed) is not fetched from. Both refused.
    pub fn fetch_from(d: &'a GranuleDescriptor) -> Result<FdSource<'a>> {
        Self::fetch_via(std::sync::Arc::new(Exporter::open(d)?), d)
    }

    /// As `fetch_from`, through an exporter already open.
    pub fn fetch_via(exporter: std::sync::Arc<Exporter>, d: &'a GranuleDescriptor) -> Result<FdSource<'a>> {
        exporter.still_exports(d.record, &d.granules)?;
        Ok(FdSource::Fetch { exporter, at: d.record, granules: &d.granules })
    }

    /// This process's descriptor for granule `i`, shared as `theirs`, and the guard that
    /// closes it if it was fetched (keep it until the granule is mapped). Refused where the
    /// file is not the one exported (`FileId`): a stale or forged descriptor.
    pub fn get(&self, i: usize, theirs: &SharedGranule) -> Result<(i32, Option<Fd>)> {
        let (fd, guard) = match self {
            FdSource::Given(fds) => fds.get(i).map(|&fd| (fd, None)).ok_or_else(|| {
                Error::InvalidArgument(format!("IPC import: {} descriptors passed, granule {i} has none", fds.len()))
            })?,
            FdSource::Fetch { exporter, at, granules } => {
                let fetched = exporter.fetch(i, theirs.fd)?;
                // Still recorded after the fetch: the descriptor was the export's then (the
                // exporter clears the record before it closes an exported descriptor).
                exporter.still_exports(*at, granules)?;
                (fetched.raw(), Some(fetched))
            }
        };
        let got = FileId::of(fd)?;
        if got != theirs.file {
            return Err(Error::InvalidArgument(format!(
                "IPC import: granule {i}'s descriptor {} is not the file the exporter shared (device {}, inode {}; found \
                 device {}, inode {}): the descriptor is stale (its block was freed and the number reused) or forged",
                theirs.fd, theirs.file.dev, theirs.file.ino, got.dev, got.ino
            )));
        }
        Ok((fd, guard))
    }
}

/// The process holding `d`'s pid is its exporter: it started when the exporter did (else
/// the exporter is gone and its pid was reused: refused, saying so).
pub fn still_the_exporter(d: &GranuleDescriptor) -> Result<()> {
    let now = start_time_of(d.pid);
    if now != d.start_time {
        return Err(Error::InvalidArgument(format!(
            "IPC import: process {} is not the exporter (it started at tick {now}, the exporter at {}): the exporter is \
             gone and its pid was reused; its blocks are no longer shared",
            d.pid, d.start_time
        )));
    }
    Ok(())
}

/// The checks an importer that fetches by pid makes (`Exporter::open` and
/// `FdSource::fetch_via`), for descriptors its exporter's handover thread handed over
/// instead (`share::handover::take_export`): the process holding the pid is the exporter
/// (its start time), `record` is that exporter's export record, and the record still holds
/// the descriptor's token beside the digest of its granule list (an altered descriptor is
/// refused).
pub fn check_handed(d: &GranuleDescriptor, record: std::os::fd::OwnedFd) -> Result<Fd> {
    use std::os::fd::IntoRawFd;
    still_the_exporter(d)?;
    let record = Fd(record.into_raw_fd());
    ExportRecord::check(&record, d.pid, d.start_time)?;
    still_handed(d, &record)?;
    Ok(record)
}

/// The exporter's record `record` (checked by `check_handed`) still holds export `d`.
pub fn still_handed(d: &GranuleDescriptor, record: &Fd) -> Result<()> {
    let pid = d.pid;
    match ExportRecord::entry_at(record, d.record.slot) {
        Some((token, _)) if token != d.record.token || token == 0 => Err(Error::InvalidArgument(format!(
            "IPC import: process {pid} no longer exports this block (the descriptor is stale: the block was freed, or its \
             memory released, after the export)"
        ))),
        Some((_, digest)) if digest != granules_digest(&d.granules) => Err(Error::InvalidArgument(format!(
            "IPC import: the descriptor's granules are not the ones process {pid} exported under its token (a forged or \
             altered descriptor)"
        ))),
        Some(_) => Ok(()),
        None => Err(Error::InvalidArgument(format!("IPC import: the export record of process {pid} cannot be read"))),
    }
}

fn fetch_error(pid: u32, what: &str) -> Error {
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::ESRCH) => Error::InvalidArgument(format!(
            "IPC import: {what} of process {pid} failed: the exporter has exited, and its blocks are no longer shared"
        )),
        Some(libc::EBADF) => Error::InvalidArgument(format!(
            "IPC import: {what} of process {pid} failed: the exporter no longer holds that descriptor (the block was \
             freed or its memory released after the export: a stale descriptor)"
        )),
        Some(libc::EPERM | libc::EACCES | libc::ENOSYS) => Error::FetchRefused {
            pid,
            detail: format!(
                "IPC import: {what} of process {pid} was refused: {e} (a container's seccomp profile or Yama's \
                 ptrace_scope forbids copying another process's descriptors)"
            ),
        },
        _ => Error::InvalidArgument(format!("IPC import: {what} of process {pid} failed: {e}")),
    }
}

