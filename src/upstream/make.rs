//! Which upstream a device pool gets: the one place that names the implementations
//! (`cuda`, `host`), above them and the interface they share.

use super::cuda::{self, CudaUpstream};
use super::host;
use super::Upstream;
use crate::error::{Error, Result};

/// Build the upstream for `device`. CUDA kinds check for the driver first and validate the
/// device id; `host` accepts ids `0..MAX_DEVICES` (simulated devices of `host_capacity`).
pub fn build(kind: crate::config::UpstreamKind, device: i32, host_capacity: usize) -> Result<Box<dyn Upstream>> {
    use crate::config::UpstreamKind as K;
    // Only here, where a device pool is being made, is the host upstream an alternative.
    let hint = |e: Error| match e {
        Error::NoDriver(m) => Error::NoDriver(format!("{m}; without a GPU, GPUPOOL_UPSTREAM=host runs the pool on host memory")),
        other => other,
    };
    Ok(match kind {
        K::Host => Box::new(host::HostUpstream::for_device(host_capacity, device)),
        K::Device => Box::new(CudaUpstream::new(device, cuda::device::DeviceMem).map_err(hint)?),
        K::Managed => Box::new(CudaUpstream::new(device, cuda::managed::ManagedMem).map_err(hint)?),
        K::Async => Box::new(CudaUpstream::new(device, cuda::async_::AsyncMem).map_err(hint)?),
        K::Vmm => Box::new(CudaUpstream::new(device, cuda::vmm::VmmMem::new()).map_err(hint)?),
    })
}

/// The page-locked host upstream of the pinned pool (events live in device 0's context).
pub fn build_pinned() -> Result<Box<dyn Upstream>> {
    Ok(Box::new(CudaUpstream::new(0, cuda::pinned::PinnedMem)?))
}
