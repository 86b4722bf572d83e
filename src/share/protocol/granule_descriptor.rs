//! The descriptor of an arena block (`GranuleDescriptor`): plain bytes naming the exporter
//! (pid, start time, its record slot and token, its handover socket) and, per allocation
//! under the block, the exporter's file descriptor number for it, the offset of the memory
//! behind it (0 for CUDA, a file offset for the host upstream's stand-in) and the file's
//! identity. Note [Sharing between processes] (`share/mod.rs`) says why each field is there.

use super::identity::{FileId, SharedGranule};
use super::record::RecordRef;
use crate::error::{Error, Result};

/// A descriptor flag: the block's memory may be paused (it is a tag's), so an importer
/// counts each open import in the exporter's opens file, and keeps the mapping idle only as
/// one of the exporter's keepers, which its pause asks to let go (`opens_file`).
pub const FLAG_PAUSABLE: u32 = 1;

/// Which memory a descriptor describes (an importer maps only its own kind).
pub const KIND_CUDA: u32 = 1;
pub const KIND_HOST: u32 = 2;

/// What the exporter says about one block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GranuleDescriptor {
    pub kind: u32,
    pub pid: u32,
    /// The exporter's start time (`start_time_of`): a process that got its pid later is not it.
    pub start_time: u64,
    /// Where the exporter records this export (`ExportRecord`): its descriptor number there,
    /// the slot and the token.
    pub record: RecordRef,
    pub device: i32,
    pub granule: u64,
    /// The block's start, from the start of its first granule.
    pub offset: u64,
    pub size: u64,
    /// Where the block's first granule is in the exporter: with the pid and start time it
    /// names that granule, so an importer can map a granule once for every block of it
    /// that it holds (`gpupool_ipc_open_dlpack`).
    pub origin: u64,
    /// The random part of the exporter's handover socket name (`share::handover`; 0: it
    /// has none): where an importer that may not copy the exporter's descriptors itself
    /// (`Error::FetchRefused`) asks the exporter for them.
    pub handover: u64,
    /// `FLAG_*` bits.
    pub flags: u32,
    pub granules: Vec<SharedGranule>,
}

const MAGIC: &[u8; 8] = b"GPPIPC06";
/// Bytes before the granules: magic, kind, pid, device, flags, granule, offset, size,
/// count, start time, record descriptor + slot, token, origin, handover.
pub const HEADER_BYTES: usize = 8 + 4 * 4 + 8 * 5 + 4 * 2 + 8 + 8 + 8;
/// Per granule: descriptor number, offset, file device, file inode.
pub const GRANULE_BYTES: usize = 32;
/// A block of more granules than this is refused (16 TiB of 2 MiB granules), so a
/// corrupt count cannot make an importer allocate without bound.
pub const MAX_GRANULES: u64 = 1 << 23;
/// The longest descriptor there can be; a longer length is refused before its bytes are read.
pub const MAX_DESCRIPTOR_BYTES: usize = HEADER_BYTES + GRANULE_BYTES * MAX_GRANULES as usize;

impl GranuleDescriptor {
    /// An importer's descriptors, one per granule, from `given`: one per granule already,
    /// or one per distinct exporter descriptor in the order the granules first name them
    /// (a chunk's granules share one: sending that list costs no per-granule work, however
    /// many granules a block lists). `None`: `given` is neither.
    pub fn per_granule<'a>(&self, given: &'a [i32]) -> Option<std::borrow::Cow<'a, [i32]>> {
        if given.len() == self.granules.len() {
            return Some(std::borrow::Cow::Borrowed(given));
        }
        let mut at: rustc_hash::FxHashMap<i32, usize> = Default::default();
        let mut out = Vec::with_capacity(self.granules.len());
        for g in &self.granules {
            let next = at.len();
            let i = *at.entry(g.fd).or_insert(next);
            out.push(*given.get(i)?);
        }
        (at.len() == given.len()).then_some(std::borrow::Cow::Owned(out))
    }

    pub fn encoded_len(&self) -> usize {
        HEADER_BYTES + GRANULE_BYTES * self.granules.len()
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(self.encoded_len());
        b.extend_from_slice(MAGIC);
        for v in [self.kind, self.pid, self.device as u32, self.flags] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        for v in [self.granule, self.offset, self.size, self.granules.len() as u64, self.start_time] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&(self.record.fd as u32).to_le_bytes());
        b.extend_from_slice(&self.record.slot.to_le_bytes());
        b.extend_from_slice(&self.record.token.to_le_bytes());
        b.extend_from_slice(&self.origin.to_le_bytes());
        b.extend_from_slice(&self.handover.to_le_bytes());
        for g in &self.granules {
            for v in [g.fd as u32 as u64, g.offset, g.file.dev, g.file.ino] {
                b.extend_from_slice(&v.to_le_bytes());
            }
        }
        b
    }

    /// Parse `b`, checking that it is whole and consistent (the bytes came from another
    /// process, maybe through a user's code).
    pub fn decode(b: &[u8]) -> Result<GranuleDescriptor> {
        let bad = |why: &str| Error::InvalidArgument(format!("IPC descriptor: {why}"));
        if b.len() < HEADER_BYTES || &b[..8] != MAGIC {
            return Err(bad("not a gpupool IPC descriptor (wrong length or magic)"));
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let (kind, pid, device, flags) = (u32_at(8), u32_at(12), u32_at(16) as i32, u32_at(20));
        let (granule, offset, size, count, start_time) = (u64_at(24), u64_at(32), u64_at(40), u64_at(48), u64_at(56));
        let record = RecordRef { fd: u32_at(64) as i32, slot: u32_at(68), token: u64_at(72) };
        let origin = u64_at(80);
        let handover = u64_at(88);
        if kind != KIND_CUDA && kind != KIND_HOST {
            return Err(bad(&format!("unknown memory kind {kind}")));
        }
        if count == 0 || count > MAX_GRANULES || b.len() != HEADER_BYTES + GRANULE_BYTES * count as usize {
            return Err(bad(&format!("{count} granules in {} bytes", b.len())));
        }
        // Checked: the numbers are another process's, and a wrapped sum would pass.
        let fits = granule.checked_mul(count).zip(offset.checked_add(size)).is_some_and(|(room, end)| end <= room);
        // The block may start past the first granule: a chunk is listed whole.
        if !granule.is_power_of_two() || size == 0 || !fits {
            return Err(bad(&format!("block of {size} bytes at offset {offset} does not fit {count} granules of {granule}")));
        }
        let granules = (0..count as usize)
            .map(|i| {
                let at = HEADER_BYTES + GRANULE_BYTES * i;
                let fd = u64_at(at);
                if fd > i32::MAX as u64 {
                    return Err(bad(&format!("granule {i}: descriptor {fd} out of range")));
                }
                Ok(SharedGranule { fd: fd as i32, offset: u64_at(at + 8), file: FileId { dev: u64_at(at + 16), ino: u64_at(at + 24) } })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(GranuleDescriptor { kind, pid, start_time, record, device, granule, offset, size, origin, handover, flags, granules })
    }
}

