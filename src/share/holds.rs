//! Holds across processes: how an exporter knows when every process it sent a block to has
//! let go of it, so the block can be freed (and its memory reused) only then.
//!
//! Why: a block shared with another process must outlive the importer's use of it, and
//! the importer may hold it for longer than the exporter's own reference to the tensor
//! lives (PyTorch promises this for CUDA tensors sent through `torch.multiprocessing`: the
//! producer's memory is not reused while a consumer holds it). A count in memory both
//! processes map is what PyTorch's `CudaIPCSentData` uses; this is the same idea with one
//! slot per send, so no slot ever has two writers that need an atomic read-modify-write
//! across processes.
//!
//! The exporter owns one *holds file* per process: a `memfd` of `SLOTS` 4-byte slots,
//! mapped shared. Each send takes a free slot and sets it to 1 (`hold`); the file's
//! descriptor travels with the send (`SCM_RIGHTS`); the importer maps the file (counting
//! the slots of it it holds, so a release, even from a tensor's destructor late in the
//! process's life, always finds it mapped) and stores 0 in its slot when it lets go. The exporter polls (`held`): a slot read as 0 goes back to the
//! free list and the exporter drops its reference to the block. A slot the importer never
//! releases (it crashed) stays held until the exporter ends, as in PyTorch. An importer
//! keeps another process's holds file mapped while it holds any of its slots (each
//! `map_theirs` counts one, each `release` or `forget` takes one off), so a consumer fed by
//! many short-lived producers does not keep every one's file mapped for good.

use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

/// Slots in a holds file (4 MiB of address space; only touched pages take memory).
pub const SLOTS: u32 = 1 << 20;
const FILE_BYTES: usize = SLOTS as usize * 4;

/// A holds file mapped in this process.
struct Mapping {
    base: *mut AtomicU32,
    len: usize,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `of`, no longer reachable (its owner is gone).
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

// SAFETY: the mapping is shared memory accessed only through atomics; the pointer is valid
// while the `Mapping` lives (it unmaps on drop, under the lock that reaches it).
unsafe impl Send for Mapping {}

impl Mapping {
    fn of(fd: i32, len: usize) -> Result<Mapping> {
        // SAFETY: mapping `len` bytes of an open file, shared, read-write.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0) };
        if p == libc::MAP_FAILED {
            return Err(Error::InvalidArgument(format!("holds file: mmap of descriptor {fd} failed: {}", std::io::Error::last_os_error())));
        }
        Ok(Mapping { base: p.cast(), len })
    }

    fn slot(&self, slot: u32) -> Result<&AtomicU32> {
        if (slot as usize + 1) * 4 > self.len {
            return Err(Error::InvalidArgument(format!("holds file: slot {slot} is past the file's {} slots", self.len / 4)));
        }
        // SAFETY: in bounds (checked), aligned (4-byte slots from a page-aligned base), and
        // the mapping lives as long as `self`.
        Ok(unsafe { &*self.base.add(slot as usize) })
    }
}

/// This process's own holds file, as an exporter.
struct Own {
    fd: i32,
    map: Mapping,
    /// Slots given back by importers, and the first slot never used.
    free: Vec<u32>,
    next: u32,
    /// One bit per slot below `next`: set while the slot is on `free`, so asking about a
    /// slot costs the same however many are free (a collect asks about every send).
    is_free: Vec<u64>,
    /// Slots held now (an importer has not let go).
    held: usize,
}

static OWN: Mutex<Option<Own>> = Mutex::new(None);
/// Holds files of other processes mapped here by file identity (device, inode), as an
/// importer, each with the count of slots of it this process holds.
type Theirs = HashMap<(u64, u64), (Mapping, usize)>;
static THEIRS: Mutex<Option<Theirs>> = Mutex::new(None);

fn create() -> Result<Own> {
    // SAFETY: plain system calls on a descriptor this function owns.
    let fd = unsafe { libc::memfd_create(c"gpupool-holds".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(Error::InvalidArgument(format!("holds file: memfd_create failed: {}", std::io::Error::last_os_error())));
    }
    if unsafe { libc::ftruncate(fd, FILE_BYTES as libc::off_t) } != 0 {
        let e = std::io::Error::last_os_error();
        unsafe { libc::close(fd) };
        return Err(Error::InvalidArgument(format!("holds file: ftruncate failed: {e}")));
    }
    // Importers write their slots, but none may resize the file: a truncated file would
    // kill this process with SIGBUS at its next hold.
    // SAFETY: fcntl on our own descriptor.
    if unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL) } != 0 {
        let e = std::io::Error::last_os_error();
        unsafe { libc::close(fd) };
        return Err(Error::InvalidArgument(format!("holds file: sealing its size failed: {e}")));
    }
    let map = Mapping::of(fd, FILE_BYTES).inspect_err(|_| unsafe {
        libc::close(fd);
    })?;
    Ok(Own { fd, map, free: Vec::new(), next: 0, is_free: Vec::new(), held: 0 })
}

/// Take a slot of this process's holds file for one send, marked held. Returns the file's
/// descriptor (this process's; it stays open until the process ends: send a copy) and
/// the slot.
pub fn hold() -> Result<(i32, u32)> {
    let mut own = OWN.lock().unwrap_or_else(|p| p.into_inner());
    if own.is_none() {
        *own = Some(create()?);
    }
    let o = own.as_mut().expect("created above");
    let slot = match o.free.pop() {
        Some(s) => {
            o.is_free[s as usize / 64] &= !(1 << (s % 64));
            s
        }
        None if o.next < SLOTS => {
            o.next += 1;
            if o.is_free.len() * 64 < o.next as usize {
                o.is_free.push(0);
            }
            o.next - 1
        }
        None => {
            return Err(Error::InvalidArgument(format!(
                "holds file: all {SLOTS} slots are held by importers (other processes hold that many shared blocks)"
            )))
        }
    };
    o.map.slot(slot)?.store(1, Ordering::Release);
    o.held += 1;
    Ok((o.fd, slot))
}

/// Whether the importer of `slot` (from `hold`) still holds it. A slot found released goes
/// back to the free list: ask once more and it may be another send's.
pub fn held(slot: u32) -> Result<bool> {
    let mut own = OWN.lock().unwrap_or_else(|p| p.into_inner());
    let Some(o) = own.as_mut() else {
        return Err(Error::InvalidArgument(format!("holds: slot {slot} was never handed out (no holds file in this process)")));
    };
    if slot >= o.next || o.is_free[slot as usize / 64] & (1 << (slot % 64)) != 0 {
        return Err(Error::InvalidArgument(format!("holds: slot {slot} is not held (never handed out, or already found released)")));
    }
    if o.map.slot(slot)?.load(Ordering::Acquire) != 0 {
        return Ok(true);
    }
    o.free.push(slot);
    o.is_free[slot as usize / 64] |= 1 << (slot % 64);
    o.held -= 1;
    Ok(false)
}

/// How many slots of this process's holds file importers still hold (as last polled).
pub fn held_count() -> usize {
    OWN.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map_or(0, |o| o.held)
}

/// Map the holds file behind `fd` (another process's; the caller keeps `fd`), so `release`
/// can find it later without a descriptor: one slot of it is held here, until `release`
/// (or `forget`) says otherwise. Returns its identity.
pub fn map_theirs(fd: i32) -> Result<(u64, u64)> {
    // SAFETY: fstat into a zeroed struct of the type it fills.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(Error::InvalidArgument(format!("holds file: fstat of descriptor {fd} failed: {}", std::io::Error::last_os_error())));
    }
    let id = (st.st_dev, st.st_ino);
    let mut theirs = THEIRS.lock().unwrap_or_else(|p| p.into_inner());
    let m = theirs.get_or_insert_with(HashMap::new);
    match m.entry(id) {
        std::collections::hash_map::Entry::Occupied(mut e) => e.get_mut().1 += 1,
        std::collections::hash_map::Entry::Vacant(e) => {
            let len = st.st_size as usize;
            if len < 4 || len % 4 != 0 {
                return Err(Error::InvalidArgument(format!("holds file: descriptor {fd} is {len} bytes, not a holds file")));
            }
            e.insert((Mapping::of(fd, len)?, 1));
        }
    }
    Ok(id)
}

/// Let go of `slot` in the holds file `id` (`map_theirs`): its exporter may free the block.
/// The file is unmapped with the last slot of it held here.
pub fn release(id: (u64, u64), slot: u32) -> Result<()> {
    let mut theirs = THEIRS.lock().unwrap_or_else(|p| p.into_inner());
    let Some((m, _)) = theirs.as_ref().and_then(|m| m.get(&id)) else {
        return Err(Error::InvalidArgument("holds: release in a holds file this process never mapped".into()));
    };
    // The slot this release counted goes either way (a slot past the file is an error).
    let stored = m.slot(slot).map(|s| s.store(0, Ordering::Release));
    drop_one(&mut theirs, id);
    stored
}

/// A slot of holds file `id` counted by `map_theirs` will not be released here (its import
/// failed, or its send's hold went elsewhere): the count goes down, as `release`'s does.
pub fn forget(id: (u64, u64)) {
    let mut theirs = THEIRS.lock().unwrap_or_else(|p| p.into_inner());
    drop_one(&mut theirs, id);
}

fn drop_one(theirs: &mut Option<Theirs>, id: (u64, u64)) {
    let Some(m) = theirs.as_mut() else { return };
    if let Some(e) = m.get_mut(&id) {
        e.1 -= 1;
        if e.1 == 0 {
            m.remove(&id);
        }
    }
}

/// Other processes' holds files mapped here.
pub fn mapped_theirs() -> usize {
    THEIRS.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map_or(0, |m| m.len())
}

/// Take one off the 64-bit count at `byte_offset` in the POSIX shared-memory object `name`
/// (as `shm_open` takes it): how PyTorch's own CUDA IPC route learns that a receiver let go
/// of a send (its `CudaIPCSentData` counts sends in such a file; the receiver gives each
/// back). `Ok(false)` where the object is gone (its sender ended, and with it the count).
/// Mapped for the moment of the change only: a count is given back once per storage, and
/// a file kept mapped would keep a sender's object alive past it.
pub fn give_back_count(name: &[u8], byte_offset: u64) -> Result<bool> {
    let bad = |why: String| Error::InvalidArgument(format!("shared count {}: {why}", String::from_utf8_lossy(name)));
    if byte_offset % 8 != 0 {
        return Err(bad(format!("offset {byte_offset} is not a multiple of 8")));
    }
    let c_name = std::ffi::CString::new(name).map_err(|_| bad("the name holds a NUL byte".into()))?;
    // SAFETY: a valid C string; the descriptor is closed below on every path.
    let fd = unsafe { libc::shm_open(c_name.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC, 0) };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::ENOENT) { Ok(false) } else { Err(bad(format!("shm_open failed: {e}"))) };
    }
    let result = (|| {
        // SAFETY: fstat into a zeroed struct of the type it fills.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd, &mut st) } != 0 {
            return Err(bad(format!("fstat failed: {}", std::io::Error::last_os_error())));
        }
        if byte_offset.checked_add(8).map_or(true, |end| end > st.st_size as u64) {
            return Err(bad(format!("offset {byte_offset} is past its {} bytes", st.st_size)));
        }
        // SAFETY: sysconf cannot fail for the page size.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64;
        let start = byte_offset / page * page;
        let len = (byte_offset - start + 8) as usize;
        // SAFETY: a shared mapping of `len` bytes of the object from a page boundary inside it.
        let base = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, start as libc::off_t) };
        if base == libc::MAP_FAILED {
            return Err(bad(format!("mmap failed: {}", std::io::Error::last_os_error())));
        }
        // SAFETY: 8 aligned bytes inside the mapping (the offset is a multiple of 8, the
        // mapping page-aligned); other processes change the count only through the same word.
        let count = unsafe { &*(base.cast::<u8>().add((byte_offset - start) as usize) as *const std::sync::atomic::AtomicI64) };
        count.fetch_sub(1, Ordering::AcqRel);
        // SAFETY: the mapping made above, no longer used.
        unsafe { libc::munmap(base, len) };
        Ok(true)
    })();
    // SAFETY: the descriptor opened above.
    unsafe { libc::close(fd) };
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_in_a_shared_object_is_given_back_once_and_a_gone_object_is_no_error() {
        let name = format!("/gpupool-count-test-{}", std::process::id());
        let c_name = std::ffi::CString::new(name.clone()).unwrap();
        let fd = unsafe { libc::shm_open(c_name.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_EXCL, 0o600) };
        assert!(fd >= 0, "{}", std::io::Error::last_os_error());
        assert_eq!(unsafe { libc::ftruncate(fd, 8192) }, 0);
        let base = unsafe { libc::mmap(std::ptr::null_mut(), 8192, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0) };
        assert_ne!(base, libc::MAP_FAILED);
        let words = base as *mut i64;
        unsafe { *words.add(8 + 3) = 2 }; // PyTorch's layout: 64 bytes, then the counts
        unsafe { *words.add(600) = 5 }; // on the second page
        assert!(give_back_count(name.as_bytes(), 64 + 3 * 8).unwrap());
        assert_eq!(unsafe { *words.add(8 + 3) }, 1);
        assert!(give_back_count(name.as_bytes(), 600 * 8).unwrap());
        assert_eq!(unsafe { *words.add(600) }, 4);
        assert_eq!(unsafe { *words.add(8 + 2) }, 0, "its neighbours are untouched");
        assert!(give_back_count(name.as_bytes(), 8190).is_err(), "past the object");
        assert!(give_back_count(name.as_bytes(), 12).is_err(), "not a word");
        unsafe { libc::munmap(base, 8192) };
        unsafe { libc::close(fd) };
        unsafe { libc::shm_unlink(c_name.as_ptr()) };
        assert!(!give_back_count(name.as_bytes(), 64).unwrap(), "gone: nothing to give back");
        assert!(give_back_count(b"/a\0b", 64).is_err());
    }

    /// The tests below share this process's holds file and its mapping as an importer.
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn a_slot_is_held_until_its_importer_releases_it_then_reused() {
        let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let (fd, a) = hold().unwrap();
        let (_, b) = hold().unwrap();
        assert_ne!(a, b);
        // The importer maps the file through its own descriptor (here: a duplicate), once
        // for each slot it receives.
        let dup = unsafe { libc::dup(fd) };
        let id = map_theirs(dup).unwrap();
        assert_eq!(map_theirs(dup).unwrap(), id);
        assert!(held(a).unwrap() && held(b).unwrap());
        release(id, a).unwrap();
        assert!(!held(a).unwrap(), "released");
        assert!(held(a).is_err(), "a released slot is asked about only once");
        assert!(held(b).unwrap(), "the other send is still held");
        let (_, c) = hold().unwrap();
        assert_eq!(c, a, "the released slot serves the next send");
        assert_eq!(map_theirs(dup).unwrap(), id);
        // A release of a slot past the file: an error, and the count it came with goes.
        assert_eq!(map_theirs(dup).unwrap(), id);
        unsafe { libc::close(dup) };
        assert!(release(id, SLOTS).is_err(), "past the file");
        assert!(release((0, 0), 0).is_err(), "a file never mapped");
        release(id, b).unwrap();
        release(id, c).unwrap();
        assert!(!held(b).unwrap() && !held(c).unwrap());
        // Every slot received was released: the file is no longer mapped here.
        assert!(release(id, b).is_err(), "unmapped with its last slot");
    }

    #[test]
    fn an_importer_cannot_resize_the_holds_file() {
        let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let (fd, slot) = hold().unwrap();
        // An importer's copy of the descriptor (here: a duplicate) names the same file.
        let theirs = unsafe { libc::dup(fd) };
        assert!(unsafe { libc::ftruncate(theirs, 0) } != 0, "the holds file was truncated");
        assert!(unsafe { libc::ftruncate(theirs, 2 * FILE_BYTES as libc::off_t) } != 0, "the holds file was grown");
        let id = map_theirs(theirs).unwrap();
        unsafe { libc::close(theirs) };
        // Slots still work both ways.
        assert!(held(slot).unwrap());
        release(id, slot).unwrap();
        assert!(!held(slot).unwrap());
    }
}
