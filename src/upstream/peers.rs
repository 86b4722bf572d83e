//! Note [Peer access on demand]
//!
//! Rationale. Arena memory is mapped with the virtual memory API, where a device reads
//! another device's memory only once granted (`cuMemSetAccess`), mapping by mapping. Granting
//! every peer on every mapping makes each growth, stitch and resume pay for every GPU of the
//! node whether any uses the memory or not (docs/benchmarks.md has a resume on two GPUs).
//! PyTorch's expandable segments grant a peer only once peer access is enabled for it.
//!
//! Approach. A device's memory is granted to the device itself and to the peers enabled for
//! it: by PyTorch's allocator hook `enablePeerAccess` (which PyTorch calls before its first
//! peer copy between two devices), by `gpupool_enable_peer_access` (C, CuPy, Python), and
//! for memory another process sends, by the importing device. Enabling a peer grants it
//! every mapping that exists then in one pass (contiguous allocations in one call), and
//! every later mapping gets it with the device's own grant.
//!
//! Implementation. This table (a bit per peer of each device, process-wide) is read when a
//! device's upstream is made, so its pools made later grant the peers already enabled;
//! `crate::registry::enable_peer_access` records a peer and asks every pool of the device
//! to grant it (`VirtualMemory::vmm_enable_peer`): `cuda/address_space.rs` on a GPU, the
//! host upstream's count for the CPU tests. `DriverCalls::peer_grants` counts the peers
//! granted, grant by grant.
//!
//! Limitations. A program that reads arena memory from another device without telling
//! PyTorch or gpupool (a raw `cudaDeviceEnablePeerAccess`, a kernel given a peer's pointer)
//! faults as it would on PyTorch's expandable segments: it must enable the peer through
//! gpupool first. Peers are never revoked.

use std::sync::atomic::{AtomicU64, Ordering};

/// Devices the table knows (peers and owners alike): a device id at or past it has no peer.
pub const MAX_PEER_DEVICES: usize = 64;

static ENABLED: [AtomicU64; MAX_PEER_DEVICES] = [const { AtomicU64::new(0) }; MAX_PEER_DEVICES];

fn index(device: i32) -> Option<usize> {
    usize::try_from(device).ok().filter(|&d| d < MAX_PEER_DEVICES)
}

/// Record that `peer` may access `owner`'s memory (-1: every device, every peer).
pub fn enable(owner: i32, peer: i32) {
    let owners: Vec<usize> = if owner == -1 { (0..MAX_PEER_DEVICES).collect() } else { index(owner).into_iter().collect() };
    for o in owners {
        let bits = if peer == -1 { u64::MAX } else { index(peer).map_or(0, |p| 1 << p) };
        ENABLED[o].fetch_or(bits & !(1 << o), Ordering::AcqRel);
    }
}

/// The peers enabled for `owner`'s memory, lowest first.
pub fn enabled(owner: i32) -> Vec<i32> {
    let Some(o) = index(owner) else { return Vec::new() };
    let mask = ENABLED[o].load(Ordering::Acquire);
    (0..MAX_PEER_DEVICES as i32).filter(|&p| mask & (1 << p) != 0).collect()
}
