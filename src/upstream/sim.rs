//! A simulated device for `gpupool-replay`: hands out address ranges of a device of
//! `capacity` bytes without touching memory, so a user's trace can be replayed against an
//! 80 GiB "GPU" on a laptop.

use super::{AllocError, Upstream};
use crate::error::Result;
use crate::stream::StreamHandle;

pub struct SimUpstream {
    capacity: usize,
    allocated: usize,
    next: usize,
}

impl SimUpstream {
    pub fn new(capacity: usize) -> Self {
        // Start high and leave gaps so distinct segments are never adjacent by accident.
        SimUpstream { capacity, allocated: 0, next: 1 << 44 }
    }
}

impl Upstream for SimUpstream {
    fn name(&self) -> &'static str {
        "simulated"
    }
    fn allocate(&mut self, size: usize, _stream: StreamHandle) -> std::result::Result<usize, AllocError> {
        if size == 0 || size > self.capacity - self.allocated {
            return Err(AllocError::OutOfMemory);
        }
        let addr = self.next;
        self.next += size.div_ceil(1 << 21) * (1 << 21) + (1 << 21);
        self.allocated += size;
        Ok(addr)
    }
    fn deallocate(&mut self, _addr: usize, size: usize, _stream: StreamHandle) -> Result<()> {
        self.allocated -= size;
        Ok(())
    }
    fn mem_info(&mut self) -> Result<(usize, usize)> {
        Ok((self.capacity - self.allocated, self.capacity))
    }
}
