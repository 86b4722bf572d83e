//! CUDA's own IPC (`cuIpcGetMemHandle` / `cuIpcOpenMemHandle`) for `cuMemAlloc` memory: how
//! blocks of the segment pools (`split`, ...) go to another process. A handle names a whole
//! allocation (a segment); the importer maps it once per process (the driver refuses a
//! second open of one allocation in the same context), so opens are counted per handle and
//! the mapping closes with the last. Each open also counts per address handed out, so a
//! close names exactly one earlier open.

use super::driver::check;
use crate::error::{Error, Result};
use crate::upstream::DriverCalls;
use cudarc::driver::sys;
use std::collections::HashMap;

/// The mappings of other processes' allocations in this context.
#[derive(Default)]
pub struct IpcHandleImports {
    /// Handle -> (where it is mapped here, opens outstanding).
    by_handle: HashMap<[u8; 64], (usize, u32)>,
    /// Address handed out -> (its allocation's handle, opens of that address outstanding).
    by_ptr: HashMap<usize, ([u8; 64], u32)>,
}

/// The handle of the `cuMemAlloc` allocation holding `ptr`.
pub fn export(ptr: usize, calls: &mut DriverCalls) -> Result<[u8; 64]> {
    let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
    calls.shareable += 1;
    check("cuIpcGetMemHandle", unsafe { sys::cuIpcGetMemHandle(&mut h, ptr as sys::CUdeviceptr) })?;
    Ok(h.reserved.map(|c| c as u8))
}

impl IpcHandleImports {
    /// Map the allocation behind `handle` (or count one more open of it) and return
    /// `offset` into it.
    pub fn open(&mut self, handle: &[u8; 64], offset: usize, calls: &mut DriverCalls) -> Result<usize> {
        let base = match self.by_handle.get_mut(handle) {
            Some((base, n)) => {
                *n += 1;
                *base
            }
            None => {
                let h = sys::CUipcMemHandle_st { reserved: handle.map(|b| b as std::ffi::c_char) };
                let mut base: sys::CUdeviceptr = 0;
                calls.shareable += 1;
                check("cuIpcOpenMemHandle", unsafe {
                    sys::cuIpcOpenMemHandle_v2(&mut base, h, sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32)
                })?;
                self.by_handle.insert(*handle, (base as usize, 1));
                base as usize
            }
        };
        let ptr = base + offset;
        self.by_ptr.entry(ptr).or_insert((*handle, 0)).1 += 1;
        Ok(ptr)
    }

    /// Undo one `open` that returned `ptr`; the allocation is unmapped with its last open.
    /// `Ok(false)`: `ptr` is no open of this kind.
    pub fn close(&mut self, ptr: usize, calls: &mut DriverCalls) -> Result<bool> {
        let Some((handle, n)) = self.by_ptr.get_mut(&ptr) else { return Ok(false) };
        let handle = *handle;
        *n -= 1;
        if *n == 0 {
            self.by_ptr.remove(&ptr);
        }
        let Some((base, opens)) = self.by_handle.get_mut(&handle) else {
            return Err(Error::Internal("IPC close: an open address without its handle".into()));
        };
        *opens -= 1;
        if *opens == 0 {
            let base = *base;
            self.by_handle.remove(&handle);
            calls.shareable += 1;
            check("cuIpcCloseMemHandle", unsafe { sys::cuIpcCloseMemHandle(base as sys::CUdeviceptr) })?;
        }
        Ok(true)
    }

    /// Whether `ptr` is an address `open` returned and not closed since.
    pub fn is_open(&self, ptr: usize) -> bool {
        self.by_ptr.contains_key(&ptr)
    }

    /// Opens outstanding.
    pub fn count(&self) -> usize {
        self.by_ptr.values().map(|(_, n)| *n as usize).sum()
    }
}
