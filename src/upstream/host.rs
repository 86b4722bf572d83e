//! The host upstream: aligned host memory standing in for a device of a fixed capacity.
//!
//! It exists so the pool logic is testable on machines without a GPU and the demo runs
//! anywhere. It never stands in for a GPU test. Its "device" has `capacity` bytes, so
//! out-of-memory paths and percentage limits behave as on a GPU.

use super::{AllocError, Upstream};
use crate::block::MIN_ALIGN;
use crate::error::Result;
use crate::stream::{StreamHandle, StreamKey, STREAM_PER_THREAD};
use std::alloc::{alloc, dealloc, Layout};

pub struct HostUpstream {
    capacity: usize,
    allocated: usize,
}

impl HostUpstream {
    pub fn new(capacity: usize) -> Self {
        HostUpstream { capacity, allocated: 0 }
    }
}

impl Upstream for HostUpstream {
    fn name(&self) -> &'static str {
        "host"
    }

    fn allocate(&mut self, size: usize, _stream: StreamHandle) -> std::result::Result<usize, AllocError> {
        if size == 0 || size > self.capacity - self.allocated {
            return Err(AllocError::OutOfMemory);
        }
        let layout = Layout::from_size_align(size, MIN_ALIGN).map_err(|_| AllocError::OutOfMemory)?;
        // SAFETY: size > 0 checked above.
        let p = unsafe { alloc(layout) };
        if p.is_null() {
            return Err(AllocError::OutOfMemory);
        }
        self.allocated += size;
        Ok(p as usize)
    }

    fn deallocate(&mut self, addr: usize, size: usize, _stream: StreamHandle) -> Result<()> {
        // SAFETY: the pool only hands back (addr, size) pairs that `allocate` returned.
        unsafe { dealloc(addr as *mut u8, Layout::from_size_align_unchecked(size, MIN_ALIGN)) };
        self.allocated -= size;
        Ok(())
    }

    fn mem_info(&mut self) -> Result<(usize, usize)> {
        Ok((self.capacity - self.allocated, self.capacity))
    }

    fn stream_key(&mut self, handle: StreamHandle) -> Result<StreamKey> {
        if handle == STREAM_PER_THREAD {
            // One per-thread stream per OS thread, as in CUDA.
            return Ok(StreamKey(0x8000_0000_0000_0000 | unsafe { libc::pthread_self() } as u64 >> 1));
        }
        Ok(StreamKey(handle as u64))
    }
}
