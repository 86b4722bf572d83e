//! The busy device of the stream tests (`streams`, `streams_arena`): an upstream whose
//! "device" is busy until the test says otherwise and which logs every event record, wait,
//! device synchronisation, unmap and alias, and pools over it.
#![allow(dead_code)] // each test crate uses part of it

use gpupool::config::PoolKind;
use gpupool::error::Result;
use gpupool::stream::StreamHandle;
use gpupool::upstream::host::HostUpstream;
use gpupool::upstream::{AliasFail, AllocError, EventHandle, Events, Ipc, Memory, VirtualMemory};
use gpupool::{Pool, PoolOptions};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

#[derive(Default)]
pub struct Device {
    /// True once all queued work has finished.
    pub idle: AtomicBool,
    pub log: Mutex<Vec<String>>,
    /// Event queries so far.
    pub queries: std::sync::atomic::AtomicUsize,
    /// While set, every event record fails (a driver that refuses them).
    pub refuse_records: AtomicBool,
    /// The next alias run fails after its mappings are made (a refused access grant).
    pub fail_next_alias: AtomicBool,
    /// This many alias removals fail next.
    pub unalias_failures: std::sync::atomic::AtomicUsize,
}

pub struct BusyUpstream {
    pub host: HostUpstream,
    pub dev: Arc<Device>,
    pub next_event: usize,
}

impl Memory for BusyUpstream {
    fn name(&self) -> &'static str {
        "busy-host"
    }
    host_memory!();
}

impl VirtualMemory for BusyUpstream {
    // The arena's virtual memory API, from the host upstream; moves are logged.
    host_address_space!();
    fn vmm_map_new(&mut self, addr: usize, len: usize) -> std::result::Result<(), AllocError> {
        self.host.vmm_map_new(addr, len)
    }
    fn vmm_unmap(&mut self, addr: usize, len: usize) -> std::result::Result<(), gpupool::upstream::UnmapFail> {
        self.dev.log.lock().unwrap().push(format!("unmap {addr:#x}"));
        self.host.vmm_unmap(addr, len)
    }
    fn vmm_alias(&mut self, homes: &[usize], to: usize) -> std::result::Result<(), AliasFail> {
        for home in homes {
            self.dev.log.lock().unwrap().push(format!("alias {home:#x}"));
        }
        self.host.vmm_alias(homes, to)?;
        if self.dev.fail_next_alias.swap(false, Ordering::SeqCst) {
            let error = gpupool::error::Error::Internal("injected: access grant refused".into());
            return Err(AliasFail { made: homes.len(), error });
        }
        Ok(())
    }
    fn vmm_unalias(&mut self, addr: usize, len: usize) -> Result<()> {
        let left = &self.dev.unalias_failures;
        if left.load(Ordering::SeqCst) > 0 {
            left.fetch_sub(1, Ordering::SeqCst);
            return Err(gpupool::error::Error::Internal("injected: unmap refused".into()));
        }
        self.host.vmm_unalias(addr, len)
    }
}

impl Ipc for BusyUpstream {}

impl Events for BusyUpstream {
    fn event_create(&mut self) -> Result<EventHandle> {
        self.next_event += 1;
        Ok(self.next_event)
    }
    fn event_record(&mut self, ev: EventHandle, s: StreamHandle) -> Result<()> {
        if self.dev.refuse_records.load(Ordering::SeqCst) {
            self.dev.log.lock().unwrap().push(format!("record ev{ev} on {s:#x} refused"));
            return Err(gpupool::error::Error::Cuda { call: "cuEventRecord", code: 999, name: "refused".into() });
        }
        self.dev.log.lock().unwrap().push(format!("record ev{ev} on {s:#x}"));
        Ok(())
    }
    fn event_query(&mut self, _ev: EventHandle) -> Result<bool> {
        self.dev.queries.fetch_add(1, Ordering::SeqCst);
        Ok(self.dev.idle.load(Ordering::SeqCst))
    }
    fn event_synchronize(&mut self, ev: EventHandle) -> Result<()> {
        self.dev.log.lock().unwrap().push(format!("sync ev{ev}"));
        self.dev.idle.store(true, Ordering::SeqCst);
        Ok(())
    }
    fn stream_wait_event(&mut self, s: StreamHandle, ev: EventHandle) -> Result<()> {
        self.dev.log.lock().unwrap().push(format!("wait {s:#x} on ev{ev}"));
        Ok(())
    }
    fn synchronize_device(&mut self) -> Result<()> {
        self.dev.log.lock().unwrap().push("device sync".into());
        self.dev.idle.store(true, Ordering::SeqCst);
        Ok(())
    }
}

pub const A: usize = 0xA00;
pub const B: usize = 0xB00;
pub const C: usize = 0xC00;

/// A pool whose user-stream frees record their event at once (`event_batch` 1): the rule
/// at its plainest. `batched` has the default batching.
pub fn pool(kind: PoolKind, ignore: bool) -> (Pool, Arc<Device>) {
    pool_with(kind, ignore, 1)
}

pub fn batched(kind: PoolKind) -> (Pool, Arc<Device>) {
    pool_with(kind, false, PoolOptions::default().event_batch)
}

pub fn pool_with(kind: PoolKind, ignore: bool, event_batch: usize) -> (Pool, Arc<Device>) {
    let dev = Arc::new(Device::default());
    let up = BusyUpstream { host: HostUpstream::new(1 << 30), dev: dev.clone(), next_event: 0 };
    // (`arena_lend` on: its stream rule is tested here; it changes nothing for other pools.)
    let opts = PoolOptions { kind, check_invariants: true, unsafe_ignore_streams: ignore, event_batch, arena_lend: true, ..Default::default() };
    (Pool::new(0, Box::new(up), &opts).unwrap(), dev)
}

pub fn log(dev: &Device) -> Vec<String> {
    std::mem::take(&mut *dev.log.lock().unwrap())
}

pub fn for_caching(f: impl Fn(PoolKind)) {
    f(PoolKind::Split);
    f(PoolKind::Binned);
    f(PoolKind::Arena);
}
