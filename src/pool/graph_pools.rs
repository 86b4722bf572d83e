//! The graph-pool routing layer: private pools, memory set aside for a CUDA graph capture,
//! a PyTorch graph pool or `MemPool`, or a capture announced from C or CuPy. Its state is
//! `PrivatePools` (the pools, the routes to them, frees held past a capture, captures
//! nobody announced), kept here. The layer's operations, which allocations go to the
//! private pools and their memory (allocation, growth, frees, release), are in
//! `graph_pools/operations.rs`.
//!
//! Note [Graph pools]
//!
//! Rationale. A captured graph bakes the addresses of the blocks it was given into its
//! kernels and uses them at every replay, long after the capture freed them. Such memory
//! must not go back to eager code while the graph lives, must be reusable by later
//! captures that share the pool (PyTorch's `pool=` argument, `make_graphed_callables`),
//! and must go back to the driver when the last user releases the pool. PyTorch's own
//! allocator keeps one private pool per `MempoolId_t` for the same reasons, and its
//! `MemPool` is the same mechanism opened to user code.
//!
//! Approach.
//! - A *route* says which allocations go to which private pool while it is active
//!   (`begin_allocate_to_pool` .. `end_allocate_to_pool`): those of streams in one capture
//!   sequence, of one stream, or those a caller's predicate accepts (PyTorch passes one).
//! - Each private pool is its own split strategy over the device's upstream: its segments
//!   are never shared with the device's main cache, so eager code cannot be handed them.
//! - A private block is reused only on the stream it was freed on: inside a capture no
//!   event may be queried, and graph order protects same-stream reuse. Frees into a private
//!   pool record nothing.
//! - `release_pool` drops one use; when none is left and no block is live, the pool's
//!   memory goes back after one device-wide synchronisation (a graph can be replayed on any
//!   stream, so no single event covers its work). Graph destruction is rare; an allocation
//!   path synchronises the device only when memory is refused and no capture may be running
//!   (`Pool::cover_by_device_sync`).
//! - While any route is active the upstream makes its calls in relaxed capture mode, and
//!   frees on a capturing stream record no event (`StreamTracker::on_free_capturing`).
//!
//! Implementation. `PrivatePools` (this file): the pools and their books;
//! `graph_pools/routes.rs`: the routes; `graph_pools/operations.rs`: routing an allocation,
//! captures nobody announced (CuPy's own `begin_capture`), frees held past a capture, and
//! the private pools' memory (allocation, growth, frees, release); the entry points:
//! `ffi/graph.rs` (C, CuPy), `ffi/torch.rs` (PyTorch's plug-in route) and the allocator
//! class's `beginAllocateToPool`
//! family (`python/gpupool/csrc/torch_allocator.cpp`). Tests: `tests/graph_pools.rs` (host),
//! `tests/python/test_graphs.py` and the class's graph and MemPool tests (GPU).
//!
//! Limitations.
//! - Private pools are cut by `split`, whatever the device's strategy, so they fragment as
//!   PyTorch's private pools do. Outside tags they are `cuMemAlloc` segments, whose blocks
//!   are shared only through CUDA's IPC handles; a tag's are mapped memory (Note [Graph
//!   pools under a tag]), which gpupool's export refuses, saying so.
//! - Giving a released pool's memory back synchronises the device once.
//!
//! Note [Graph pools under a tag]
//!
//! Rationale. A serving engine captures a decode graph per batch size and keeps workspaces
//! in `MemPool`s: gigabytes that a sleeping engine must give back too, and that its graphs
//! find at the same addresses when it wakes (torch_memory_saver and vLLM's sleep mode
//! release them). Private pools of `cuMemAlloc` segments cannot be given back at a kept
//! address.
//!
//! Approach. A private pool made while its thread allocates under a tag (a
//! `torch.cuda.graph` or `use_mem_pool` block inside `with gpupool.tag(...)`, or
//! `gpupool_begin_allocate_to_pool` between `gpupool_tag_begin` and `_end`) lives in the
//! tag's pool, and its segments are mapped virtual memory of the tag's arena upstream, in
//! allocations of the tag's granule, each in an address range of its own. A pause of the
//! tag releases them with the rest of its memory (the upstream pauses every allocation it
//! mapped) and the resume maps them again, so the captured graphs replay. Every later call
//! about the pool (a route's end, a release, a use count) finds its home, wherever the
//! caller's thread is then. While a route is active anywhere, an allocation asks the tags'
//! routes first, then shard 0's, then goes where it would at any other time: a capture
//! begun outside every tag keeps its memory out of tags, whichever tag the allocating
//! thread is under. And while any route is active on a device, every pool of that device
//! acts as a capture may run (`upstream::capture_routes`): relaxed driver calls, frees that
//! ask whether their stream captures, no device-wide wait.
//!
//! Implementation. `crate::registry` (`private_pools.rs`) finds a private pool's home and
//! keeps which tag pools route allocations; `crate::front` (`malloc_while_routed`) asks
//! them; `PrivatePools::mapped` and `private_segment` here make the segments;
//! `Core::deallocate_private` gives them back. Tests: `tests/tags.rs` (host),
//! `tests/python/test_tags.py` (GPU: graphs and a `MemPool` under a tag paused and resumed).
//!
//! Limitations. A pause refuses while a route into the tag is active (a capture or a
//! `use_mem_pool` block in progress) and while its stream captures; a private pool released
//! while its tag is paused goes at the resume. A private pool keeps the home it was made
//! in: a `MemPool` made outside a tag and used inside one stays outside it (make it under
//! the tag). A capture CuPy starts itself (`Stream.begin_capture` without gpupool's helper)
//! keeps its memory in shard 0. Each private segment is at least a tag granule (32 MiB).
//! The tags' routes are asked before shard 0's whatever their order: a `use_mem_pool` of a
//! pool made outside tags, nested inside a capture begun under a tag, serves the capture's
//! pool. Relaxed capture mode is per device, while CUDA's global mode spans the process: a
//! tag's pool growing on one device during a global-mode capture on another may still
//! invalidate that capture (PyTorch captures in global mode by default on the capturing
//! device).

mod operations;
mod routes;

pub use routes::{routes_active, Callback, Filter};
pub(super) use routes::forget_routes;

use crate::block::Block;
use crate::strategy::{self, Strategy};
use crate::stream::StreamHandle;
use crate::upstream::AllocError;
use routes::Route;
use rustc_hash::FxHashMap;

pub use super::core::PoolId;

/// Second half of the ids of pools named from C (`gpupool_begin_allocate_to_pool`).
pub const C_POOL_TAG: u64 = u64::MAX;
/// Second half of the ids of pools made for captures nobody announced (CuPy's
/// `Stream.begin_capture` without the helper); the first half is the capture id.
pub const IMPLICIT_POOL_TAG: u64 = u64::MAX - 1;

struct PrivatePool {
    strategy: Box<dyn Strategy>,
    /// Begins minus releases (PyTorch's use count): the pool is kept while above zero.
    uses: i64,
    /// Blocks of this pool in the live map.
    live: usize,
    /// Bytes of segments this pool holds.
    reserved: usize,
    /// Blocks freed while also used on other streams (`record_stream`): kept out of reuse
    /// until the pool goes, since no event may be asked about while its graphs capture.
    quarantined: Vec<Block>,
}

impl PrivatePool {
    fn new(uses: i64) -> Self {
        PrivatePool { strategy: strategy::build(crate::config::PoolKind::Split), uses, live: 0, reserved: 0, quarantined: Vec::new() }
    }
}

/// A device pool's private pools and routes.
#[derive(Default)]
pub struct PrivatePools {
    /// Private segments are mapped virtual memory of the pool's arena upstream (a tag's
    /// pool: Note [Graph pools under a tag]) rather than `cuMemAlloc` memory.
    mapped: bool,
    pools: FxHashMap<PoolId, PrivatePool>,
    routes: Vec<Route>,
    /// Main-pool frees held while a route is active because a stream they were used on
    /// (`record_stream`) was capturing: an event recorded there would belong to the graph.
    /// Replayed when the last route ends.
    capture_deferred: Vec<(Block, Vec<StreamHandle>)>,
    /// Streams seen capturing a graph nobody announced (CuPy's own `begin_capture`), with
    /// the capture's id: while any is, no device-wide wait may be made (it would break the
    /// capture). A stream leaves when a later call on it (its handle alive then) finds it
    /// no longer capturing, or when its capture's pool is released.
    unannounced: FxHashMap<StreamHandle, u64>,
}

impl PrivatePools {
    /// Private pools of `cuMemAlloc` segments, or (`mapped`) of mapped virtual memory.
    pub fn new(mapped: bool) -> Self {
        PrivatePools { mapped, ..Default::default() }
    }
    pub fn has_routes(&self) -> bool {
        !self.routes.is_empty()
    }
    /// May the pool wait for the whole device now? Not while a capture on this device may
    /// run that the wait would invalidate: a route announced to this pool, or a stream seen
    /// capturing a graph nobody announced (CuPy's `stream.begin_capture()`) and not seen
    /// to have stopped since (`unannounced`).
    /// (The wait covers this device's context only; captures elsewhere are not asked about.)
    pub fn device_sync_allowed(&self) -> bool {
        self.routes.is_empty() && self.unannounced.is_empty()
    }
    /// What a call on `stream` (alive now) learned of its capture: `Some(id)` capturing.
    fn note_capture(&mut self, stream: StreamHandle, capture: Option<u64>) {
        match capture {
            Some(id) => {
                self.unannounced.insert(stream, id);
            }
            None => {
                self.unannounced.remove(&stream);
            }
        }
    }
    /// Bytes held free in private pools (for the books and the status report).
    pub fn cached_bytes(&self) -> usize {
        self.pools.values().map(|p| p.strategy.cached_bytes()).sum()
    }
    pub fn reserved_bytes(&self) -> usize {
        self.pools.values().map(|p| p.reserved).sum()
    }
    pub fn count(&self) -> usize {
        self.pools.len()
    }
    pub fn free_blocks(&self) -> Vec<Block> {
        self.pools.values().flat_map(|p| p.strategy.free_blocks()).collect()
    }
    /// Free blocks with the id of the private pool holding each (snapshots).
    pub fn free_blocks_by_pool(&self) -> Vec<(PoolId, Block)> {
        self.pools.iter().flat_map(|(id, p)| p.strategy.free_blocks().into_iter().map(move |b| (*id, b))).collect()
    }
    pub fn is_free_block(&self, addr: usize) -> bool {
        self.pools.values().any(|p| p.strategy.is_free_block(addr) || p.quarantined.iter().any(|b| b.addr == addr))
            || self.capture_deferred.iter().any(|(b, _)| b.addr == addr)
    }
    /// Blocks freed but not reusable yet: quarantined private blocks and frees held past a
    /// capture (books, snapshots).
    pub fn pending_blocks(&self) -> Vec<Block> {
        let q = self.pools.values().flat_map(|p| p.quarantined.iter().copied());
        q.chain(self.capture_deferred.iter().map(|(b, _)| *b)).collect()
    }
    /// Routes active now on this device.
    pub fn route_count(&self) -> usize {
        self.routes.len()
    }
    /// The size of the segment at `base` of private pool `id` (for `segment_of`).
    pub fn segment_len(&self, id: PoolId, base: usize) -> Option<usize> {
        self.pools.get(&id).and_then(|p| p.strategy.segment_len(base))
    }
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        for (id, p) in &self.pools {
            p.strategy.check_invariants().map_err(|e| format!("private pool {id:?}: {e}"))?;
        }
        Ok(())
    }
}

/// A private pool's new segment of `len` bytes: `cuMemAlloc` memory, or where private
/// pools are mapped (a tag's pool) an address range of its own over one physical
/// allocation, which the pool's pause releases and its resume maps again as it does the
/// arena's memory (`VirtualMemory::vmm_pause` covers every allocation it mapped).
fn private_segment(up: &mut dyn crate::upstream::Upstream, mapped: bool, len: usize, on: StreamHandle) -> std::result::Result<usize, AllocError> {
    if !mapped {
        return up.allocate(len, on);
    }
    let base = up.vmm_reserve(len).map_err(AllocError::Other)?;
    if let Err(e) = up.vmm_map_chunk(base, len) {
        let _ = up.vmm_unreserve(base, len);
        return Err(e);
    }
    Ok(base)
}

