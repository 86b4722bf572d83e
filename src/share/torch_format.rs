//! Note [PyTorch's handle formats]
//!
//! Rationale. A CUDA tensor sent through `torch.multiprocessing` (or `reduce_tensor`, as
//! vLLM's and SGLang's weight updates call it) carries the string its sender's allocator
//! made in `shareIpcHandle`, and the receiver's allocator opens it in `getIpcDevPtr`. A
//! receiver on PyTorch's own allocator reads two formats only: a version byte, then `c`
//! and CUDA's IPC handle of a `cudaMalloc` segment, or `e` and an expandable segment (a
//! header `{pid, segment_size, num_handles}` and one POSIX descriptor number of the sender
//! per physical allocation, all of one size, which it copies with `pidfd_getfd` and maps
//! side by side). Anything else is "a future version of torch". So gpupool's class emits
//! those formats wherever its memory can be described so, and its own receivers still get
//! everything gpupool's descriptor gives (export checks, kept imports, the handover route
//! in containers).
//!
//! Approach. The handle is PyTorch's bytes, then a trailer PyTorch's reader never reaches
//! (it reads exactly the bytes its header announces): a magic, the block's offset in what
//! the PyTorch bytes map, and gpupool's descriptor. A gpupool receiver finds the trailer
//! and opens the descriptor; a PyTorch receiver opens the prefix. The offset PyTorch adds
//! to the mapping travels apart (`ShareableHandle::offset`), so both receivers return the
//! start of what the prefix maps.
//!
//! Implementation. A segment pool's block (`split`, `binned`, `none`) lies in a
//! `cuMemAlloc` segment: `c` with the segment's handle, offset the block's place in it. An
//! arena block is `e` where the allocations under it are all of one size (granules, or
//! chunks of one size), segment size that size; offset the block's start past the first
//! allocation's. Handles are the same bytes for every send of a block (its export is
//! reused), so receivers' caches keyed by the string map it once.
//!
//! Limitations. An arena block over allocations of different sizes (a chunk and granules
//! beside it) has no `e` form: it goes in gpupool's format alone, which only gpupool
//! receivers open (`OLD_MAGIC`). A tag's memory never has such blocks: the registry maps
//! it granule by granule, since tags hold what is sent (weights) and allocate it once. Host-upstream memory has none either. A PyTorch receiver
//! of `e` copies the sender's descriptors with `pidfd_getfd`, which containers without
//! CAP_SYS_PTRACE refuse (as for PyTorch's own expandable segments); `c` needs no such
//! right. The version byte is the lowest that knows both types.

use crate::error::{Error, Result};
use crate::registry;
use crate::share::protocol::SegmentDescriptor;
use crate::share::protocol::{GranuleDescriptor, FileId, SharedGranule, KIND_CUDA};
use std::ffi::c_int;
use std::os::fd::{AsRawFd, FromRawFd};

use super::descriptor::AnyDescriptor;

/// PyTorch's `SHAREABLE_HANDLE_VERSION` this writes: receivers take any version up to theirs.
pub const VERSION: u8 = 2;
const CUDA_MALLOC: u8 = b'c';
const EXPANDABLE: u8 = b'e';
const CUDA_IPC_HANDLE_BYTES: usize = 64;
/// `ShareHeader`: a 4-byte pid, 4 bytes of padding, two 8-byte sizes.
const SHARE_HEADER_BYTES: usize = 24;
/// Starts gpupool's trailer after PyTorch's bytes.
const TRAILER: &[u8; 12] = b"gpupool-ipc2";
/// Starts a handle of gpupool's format alone (a block with no PyTorch form).
const OLD_MAGIC: &[u8; 12] = b"gpupool-ipc1";
/// Handles of an expandable segment longer than this are refused unread.
const MAX_HANDLES: u64 = 1 << 23;

/// A handle as `shareIpcHandle` returns it.
#[derive(Debug, PartialEq, Eq)]
pub struct Handle {
    pub bytes: Vec<u8>,
    /// Where the block starts in what the handle maps.
    pub offset: u64,
}

/// The handle of a block exported as `d`, whose encoded bytes are `raw`.
pub fn encode(d: &AnyDescriptor, raw: &[u8]) -> Handle {
    let (prefix, offset) = match d {
        AnyDescriptor::Segment(l) => {
            let mut p = vec![VERSION, CUDA_MALLOC];
            p.extend_from_slice(&l.handle);
            (p, l.offset)
        }
        AnyDescriptor::Arena(d) => match expandable(d) {
            Some(p) => (p, d.offset),
            None => {
                let mut bytes = OLD_MAGIC.to_vec();
                bytes.extend_from_slice(raw);
                return Handle { bytes, offset: 0 };
            }
        },
    };
    let mut bytes = prefix;
    bytes.extend_from_slice(TRAILER);
    bytes.extend_from_slice(&offset.to_le_bytes());
    bytes.extend_from_slice(raw);
    Handle { bytes, offset }
}

/// PyTorch's `e` bytes for `d`: its allocations all of one size, else `None`.
fn expandable(d: &GranuleDescriptor) -> Option<Vec<u8>> {
    if d.kind != KIND_CUDA {
        return None;
    }
    let runs = allocations(d);
    let each = runs.first()?.1;
    if runs.iter().any(|&(_, n)| n != each) {
        return None;
    }
    let mut p = vec![VERSION, EXPANDABLE];
    p.extend_from_slice(&(d.pid as i32).to_ne_bytes());
    p.extend_from_slice(&[0; 4]);
    p.extend_from_slice(&(each as u64 * d.granule).to_ne_bytes());
    p.extend_from_slice(&(runs.len() as u64).to_ne_bytes());
    for &(fd, _) in &runs {
        p.extend_from_slice(&fd.to_ne_bytes());
    }
    Some(p)
}

/// The allocations `d` lists, as (the exporter's descriptor, granules): consecutive
/// granules of one descriptor at offsets 0, 1, 2, ... granules are one allocation.
fn allocations(d: &GranuleDescriptor) -> Vec<(i32, usize)> {
    let mut out: Vec<(i32, usize)> = Vec::new();
    for g in &d.granules {
        match out.last_mut() {
            Some((fd, n)) if *fd == g.fd && g.offset == *n as u64 * d.granule => *n += 1,
            _ => out.push((g.fd, 1)),
        }
    }
    out
}

/// What a handle holds.
#[derive(Debug, PartialEq, Eq)]
pub enum Parsed<'a> {
    /// gpupool's descriptor, the block `offset` bytes into what the handle maps.
    Library { descriptor: &'a [u8], offset: u64 },
    /// PyTorch's `c` from a process on its own allocator: CUDA's IPC handle of a segment.
    CudaIpc([u8; CUDA_IPC_HANDLE_BYTES]),
    /// PyTorch's `e` from a process on its own allocator (expandable segments).
    Expandable { pid: u32, segment_size: u64, fds: Vec<i32> },
}

/// Read a handle another process's allocator made (its bytes are that process's word).
pub fn decode(b: &[u8]) -> Result<Parsed<'_>> {
    let bad = |why: String| Error::InvalidArgument(format!("IPC handle: {why}"));
    if let Some(rest) = b.strip_prefix(OLD_MAGIC.as_slice()) {
        return Ok(Parsed::Library { descriptor: rest, offset: 0 });
    }
    if b.len() == CUDA_IPC_HANDLE_BYTES {
        // PyTorch before versioned handles: a bare CUDA IPC handle.
        return Ok(Parsed::CudaIpc(b.try_into().expect("64 bytes")));
    }
    if b.len() < 2 {
        return Err(bad(format!("{} bytes are no handle", b.len())));
    }
    if b[0] > VERSION && !b[2..].windows(TRAILER.len()).any(|w| w == TRAILER) {
        return Err(bad(format!(
            "version {} of PyTorch's format, newer than {VERSION}, which gpupool reads; install gpupool in the sending \
             process too, or send from a PyTorch of the receiver's version",
            b[0]
        )));
    }
    let (prefix_len, parsed) = match b[1] {
        CUDA_MALLOC => {
            let end = 2 + CUDA_IPC_HANDLE_BYTES;
            let h = b.get(2..end).ok_or_else(|| bad(format!("a `c` handle of {} bytes", b.len())))?;
            (end, Parsed::CudaIpc(h.try_into().expect("64 bytes")))
        }
        EXPANDABLE => {
            let head = b.get(2..2 + SHARE_HEADER_BYTES).ok_or_else(|| bad(format!("an `e` handle of {} bytes", b.len())))?;
            let pid = i32::from_ne_bytes(head[..4].try_into().expect("4 bytes"));
            let segment_size = u64::from_ne_bytes(head[8..16].try_into().expect("8 bytes"));
            let n = u64::from_ne_bytes(head[16..24].try_into().expect("8 bytes"));
            if pid <= 0 || n == 0 || n > MAX_HANDLES || segment_size == 0 {
                return Err(bad(format!("an `e` header of pid {pid}, {n} allocations of {segment_size} bytes")));
            }
            let end = 2 + SHARE_HEADER_BYTES + 4 * n as usize;
            let fds = b.get(2 + SHARE_HEADER_BYTES..end).ok_or_else(|| bad(format!("{n} descriptors in {} bytes", b.len())))?;
            let fds = fds.chunks_exact(4).map(|c| i32::from_ne_bytes(c.try_into().expect("4 bytes"))).collect();
            (end, Parsed::Expandable { pid: pid as u32, segment_size, fds })
        }
        t => return Err(bad(format!("type byte {t:#x}, neither PyTorch's `c` nor `e`, nor gpupool's"))),
    };
    match b[prefix_len..].strip_prefix(TRAILER.as_slice()) {
        Some(rest) if rest.len() >= 8 => {
            let offset = u64::from_le_bytes(rest[..8].try_into().expect("8 bytes"));
            Ok(Parsed::Library { descriptor: &rest[8..], offset })
        }
        Some(_) => Err(bad("a gpupool trailer cut short".into())),
        None => Ok(parsed),
    }
}

/// Open a handle an allocator class made in `shareIpcHandle` (this module's formats) on
/// `device`: (the address PyTorch adds the storage's offset to, the address
/// `gpupool_ipc_close` takes).
pub fn open(handle: &[u8], device: c_int) -> Result<(usize, usize)> {
    match decode(handle)? {
        Parsed::Library { descriptor, offset } => {
            let block = AnyDescriptor::decode(descriptor)?.open(device, None)?;
            Ok((block - offset as usize, block))
        }
        Parsed::CudaIpc(h) => {
            // PyTorch's own segment: the storage's offset travels apart; the segment opens whole.
            let base = registry::with_pool(device, |pool| pool.importer().import_segment(&SegmentDescriptor { pid: 0, device, start_time: 0, handle: h, offset: 0, size: 0 }))?;
            Ok((base, base))
        }
        Parsed::Expandable { pid, segment_size, fds } => {
            let base = open_expandable(pid, segment_size, &fds, device)?;
            Ok((base, base))
        }
    }
}

/// Map an expandable segment a process on PyTorch's own allocator shared: its allocations
/// (`segment_size` each, behind the sender's descriptors `theirs`) copied with
/// `pidfd_getfd`, as PyTorch's receiver does, and mapped side by side as an import of
/// granule-sized pieces. Such a sender keeps no export record: the copies are trusted as
/// PyTorch's receiver trusts them.
fn open_expandable(pid: u32, segment_size: u64, theirs: &[i32], device: c_int) -> Result<usize> {
    const GRANULE: u64 = 2 << 20;
    if segment_size % GRANULE != 0 {
        return Err(Error::InvalidArgument(format!(
            "IPC import: PyTorch's expandable segment of {segment_size}-byte pages is not a whole number of {GRANULE}-byte granules"
        )));
    }
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if pidfd < 0 {
        return Err(Error::InvalidArgument(format!(
            "IPC import: pidfd_open of process {pid} failed: {} (the sender, on PyTorch's expandable segments, has exited?)",
            std::io::Error::last_os_error()
        )));
    }
    let pidfd = unsafe { std::os::fd::OwnedFd::from_raw_fd(pidfd as i32) };
    let mut mine = Vec::with_capacity(theirs.len());
    let mut granules = Vec::new();
    for (i, &fd) in theirs.iter().enumerate() {
        let got = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
        if got < 0 {
            return Err(Error::InvalidArgument(format!(
                "IPC import: pidfd_getfd of descriptor {fd} of process {pid} failed: {}. The sender is on PyTorch's \
                 expandable segments, whose receivers copy its descriptors (a container without CAP_SYS_PTRACE refuses \
                 that, for PyTorch's own receivers too): turn expandable segments off in the sender, or install gpupool \
                 in both processes (gpupool's handles reach gpupool receivers in containers)",
                std::io::Error::last_os_error()
            )));
        }
        let got = unsafe { std::os::fd::OwnedFd::from_raw_fd(got as i32) };
        let file = FileId::of(got.as_raw_fd())?;
        for k in 0..segment_size / GRANULE {
            granules.push(SharedGranule { fd: i as i32, offset: k * GRANULE, file });
        }
        mine.push(got);
    }
    let d = GranuleDescriptor {
        kind: KIND_CUDA,
        pid,
        start_time: 0,
        record: Default::default(),
        device,
        granule: GRANULE,
        offset: 0,
        size: segment_size * theirs.len() as u64,
        origin: 0,
        handover: 0,
        flags: 0,
        granules,
    };
    let raw: Vec<c_int> = mine.iter().map(|f| f.as_raw_fd()).collect();
    registry::with_pool(device, |pool| pool.importer().import(&d, Some(&raw)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::share::protocol::SegmentDescriptor;
    use crate::share::protocol::{FileId, SharedGranule};

    const G: u64 = 2 << 20;

    fn arena(granules: &[(i32, u64)], offset: u64) -> GranuleDescriptor {
        GranuleDescriptor {
            kind: KIND_CUDA,
            pid: 4242,
            start_time: 1,
            record: Default::default(),
            device: 0,
            granule: G,
            offset,
            size: 1,
            origin: 0,
            handover: 0,
            flags: 0,
            granules: granules.iter().map(|&(fd, o)| SharedGranule { fd, offset: o * G, file: FileId { dev: 1, ino: fd as u64 } }).collect(),
        }
    }

    fn roundtrip(d: AnyDescriptor, raw: &[u8]) -> (Handle, Vec<u8>) {
        let h = encode(&d, raw);
        let prefix_end = h.bytes.windows(TRAILER.len()).position(|w| w == TRAILER).unwrap_or(0);
        match decode(&h.bytes).unwrap() {
            Parsed::Library { descriptor, offset } => {
                assert_eq!((descriptor, offset), (raw, h.offset), "gpupool's receiver finds the descriptor and offset")
            }
            other => panic!("{other:?}"),
        }
        let prefix = h.bytes[..prefix_end].to_vec();
        (h, prefix)
    }

    #[test]
    fn granules_are_an_expandable_segment_of_granule_size_with_the_descriptor_behind() {
        let d = arena(&[(7, 0), (9, 0), (11, 0)], 4096);
        let (h, prefix) = roundtrip(AnyDescriptor::Arena(d.clone()), b"DESCRIPTOR");
        assert_eq!(h.offset, 4096);
        assert_eq!(&prefix[..2], &[VERSION, b'e']);
        // What PyTorch's reader takes: the prefix alone.
        assert_eq!(decode(&prefix).unwrap(), Parsed::Expandable { pid: 4242, segment_size: G, fds: vec![7, 9, 11] });
        assert_eq!(prefix.len(), 2 + SHARE_HEADER_BYTES + 3 * 4);
    }

    #[test]
    fn chunks_of_one_size_are_one_handle_each_and_mixed_sizes_have_no_pytorch_form() {
        let chunks = arena(&[(5, 0), (5, 1), (5, 2), (6, 0), (6, 1), (6, 2)], 0);
        let (_, prefix) = roundtrip(AnyDescriptor::Arena(chunks), b"D");
        assert_eq!(decode(&prefix).unwrap(), Parsed::Expandable { pid: 4242, segment_size: 3 * G, fds: vec![5, 6] });
        let mixed = arena(&[(5, 0), (5, 1), (6, 0)], 0);
        let h = encode(&AnyDescriptor::Arena(mixed), b"D");
        assert_eq!((h.bytes.as_slice(), h.offset), ([OLD_MAGIC.as_slice(), b"D"].concat().as_slice(), 0));
        assert_eq!(decode(&h.bytes).unwrap(), Parsed::Library { descriptor: b"D", offset: 0 });
    }

    #[test]
    fn a_segment_block_is_cudas_handle_and_its_offset() {
        let l = SegmentDescriptor { pid: 1, device: 0, start_time: 2, handle: [3; 64], offset: 1536, size: 10 };
        let raw = l.encode();
        let (h, prefix) = roundtrip(AnyDescriptor::Segment(l), &raw);
        assert_eq!(h.offset, 1536);
        assert_eq!(decode(&prefix).unwrap(), Parsed::CudaIpc([3; 64]));
        // PyTorch's own: versioned and bare.
        assert_eq!(decode(&[3u8; 64]).unwrap(), Parsed::CudaIpc([3; 64]));
    }

    #[test]
    fn damaged_or_unknown_handles_are_refused_saying_what_they_are() {
        let e = |b: &[u8]| decode(b).unwrap_err().to_string();
        assert!(e(&[2, b'x', 0, 0]).contains("type byte 0x78"));
        assert!(e(&[9, b'c']).contains("version 9"));
        assert!(e(&[2, b'c', 1, 2]).contains("`c` handle of 4 bytes"));
        let mut head = vec![2, b'e'];
        head.extend_from_slice(&[1, 0, 0, 0, 0, 0, 0, 0]);
        head.extend_from_slice(&G.to_ne_bytes());
        head.extend_from_slice(&u64::MAX.to_ne_bytes());
        assert!(e(&head).contains("allocations of"));
        let (h, _) = roundtrip(AnyDescriptor::Arena(arena(&[(7, 0)], 0)), b"D");
        let cut = h.bytes.len() - 1 - 8;
        assert!(e(&h.bytes[..cut]).contains("cut short"));
    }
}
