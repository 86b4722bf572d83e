//! The descriptor of a block of a segment pool (`split`, ...), shared through CUDA's own IPC:
//! the handle of the block's segment (`cuIpcGetMemHandle`) and where the block lies in it.
//! Plain bytes, like an arena block's (`granule_descriptor.rs`), with a magic of its own so one
//! open call takes either. No file descriptors travel: the driver resolves the handle.

use crate::error::{Error, Result};

const MAGIC: &[u8; 8] = b"GPPLEG01";
/// Encoded length.
pub const SEGMENT_DESCRIPTOR_BYTES: usize = 8 + 4 + 4 + 8 + 64 + 8 + 8;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentDescriptor {
    pub pid: u32,
    pub device: i32,
    /// The exporter's start time (`protocol::start_time_of`): a reused pid is another process.
    pub start_time: u64,
    /// The segment's `CUipcMemHandle`.
    pub handle: [u8; 64],
    /// Where the block starts in the segment, and its size.
    pub offset: u64,
    pub size: u64,
}

impl SegmentDescriptor {
    /// Whether `b` starts as a descriptor of this kind.
    pub fn is_one(b: &[u8]) -> bool {
        b.starts_with(MAGIC)
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(SEGMENT_DESCRIPTOR_BYTES);
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&self.pid.to_le_bytes());
        b.extend_from_slice(&self.device.to_le_bytes());
        b.extend_from_slice(&self.start_time.to_le_bytes());
        b.extend_from_slice(&self.handle);
        b.extend_from_slice(&self.offset.to_le_bytes());
        b.extend_from_slice(&self.size.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<SegmentDescriptor> {
        if b.len() != SEGMENT_DESCRIPTOR_BYTES || !Self::is_one(b) {
            return Err(Error::InvalidArgument(format!(
                "IPC descriptor: {} bytes are not a gpupool segment descriptor ({SEGMENT_DESCRIPTOR_BYTES} bytes, magic GPPLEG01)",
                b.len()
            )));
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Ok(SegmentDescriptor {
            pid: u32_at(8),
            device: u32_at(12) as i32,
            start_time: u64_at(16),
            handle: b[24..88].try_into().expect("64 bytes"),
            offset: u64_at(88),
            size: u64_at(96),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_other_bytes() {
        let d = SegmentDescriptor { pid: 42, device: 1, start_time: 7, handle: [9; 64], offset: 4096, size: 100 };
        let b = d.encode();
        assert_eq!(b.len(), SEGMENT_DESCRIPTOR_BYTES);
        assert_eq!(SegmentDescriptor::decode(&b).unwrap(), d);
        assert!(SegmentDescriptor::decode(&b[..50]).is_err());
        let mut bad = b.clone();
        bad[0] ^= 1;
        assert!(!SegmentDescriptor::is_one(&bad) && SegmentDescriptor::decode(&bad).is_err());
    }
}
