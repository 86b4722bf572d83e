//! What the pool tells: statistics, the status report and its JSON, leaks, the segment of a
//! block, the arena's figures, a snapshot's segments, the thread caches' counts and what
//! they keep, and the full consistency scan the tests run after every operation.

use super::arena::ArenaFigures;
use super::Pool;
use crate::block::Block;
use crate::debug::Leak;
use crate::error::Result;
use crate::stats::{render_json, render_status, ReportContext, Stats, STATS_VERSION};

impl Pool {
    /// The arena's figures for the reports (`None` for other pools); a device's reports add
    /// its shards' up.
    pub fn arena_figures(&self) -> Option<ArenaFigures> {
        ArenaFigures::of(&self.core)
    }

    /// The `segments` array's items of this pool's snapshot (`registry::snapshot_json` joins
    /// a device's pools').
    pub(crate) fn snapshot_segments(&self) -> String {
        super::snapshot::segments(&self.core, &self.caches, &self.graphs)
    }

    /// Thread caches registered with this pool (exited threads' until the next locked
    /// operation reaps them), and the blocks their users freed that they keep.
    pub fn thread_caches(&self) -> (usize, usize) {
        (self.caches.count(), self.caches.kept().len())
    }

    /// Count, bytes and requested bytes of the blocks kept (freed) in thread caches.
    pub(super) fn kept_bytes(&self) -> (usize, usize, usize) {
        let kept = self.caches.kept();
        let n = kept.len();
        kept.iter().filter_map(|&p| self.core.live(p)).fold((n, 0, 0), |a, l| (a.0, a.1 + l.block.size, a.2 + l.requested))
    }

    /// Every live allocation, for the leak report.
    pub fn leaks(&self) -> Vec<Leak> {
        let kept = self.caches.kept();
        self.core
            .live_blocks()
            .filter(|l| !kept.contains(&l.block.addr))
            .map(|l| Leak::new(self.core.device(), l.block.addr, l.block.size, l.requested, l.rec.as_deref()))
            .collect()
    }

    /// The size of the live block at `ptr` (what the pool counts in use for it).
    pub(crate) fn block_size(&self, ptr: usize) -> Result<usize> {
        match self.core.live(ptr) {
            Some(l) => Ok(l.block.size),
            None => Err(self.classify_bad_pointer(ptr)),
        }
    }

    /// The upstream allocation that holds the live block at `ptr`: `(base, size)`.
    pub(crate) fn segment_of(&self, ptr: usize) -> Result<(usize, usize)> {
        let Some(l) = self.core.live(ptr) else {
            return Err(self.classify_bad_pointer(ptr));
        };
        if let Some(id) = l.private {
            let base = l.block.segment;
            return Ok((base, self.graphs.segment_len(id, base).unwrap_or(l.block.size)));
        }
        if self.core.is_arena() {
            // The arena has no upstream allocations per block: the block is its own range.
            return Ok((l.block.addr, l.block.size));
        }
        let base = l.block.segment;
        Ok((base, self.core.strategy().segment_len(base).unwrap_or(l.block.size)))
    }

    pub fn stats(&mut self) -> Stats {
        // A block a thread cache hands back is live again with no locked call: the peaks
        // are at least what is live now.
        self.bump_peaks();
        let (dev_free, dev_total) = self.core.upstream_mut().mem_info().unwrap_or((0, 0));
        // Blocks kept in thread caches count as freed (their users freed them), and the
        // fast path's operations as operations.
        let (n_kept, kept, kept_requested) = self.kept_bytes();
        let (fast_allocs, fast_frees) = self.caches.fast_counts();
        let used = self.rec.c.used - kept;
        Stats {
            struct_size: std::mem::size_of::<Stats>() as u32,
            version: STATS_VERSION,
            used_bytes: used as u64,
            free_bytes: (self.rec.c.reserved - used) as u64,
            total_bytes: self.rec.c.reserved as u64,
            n_free_blocks: (self.core.strategy().free_block_count() + n_kept) as u64,
            n_live_blocks: (self.core.live_count() - n_kept) as u64,
            requested_bytes: (self.rec.c.requested - kept_requested) as u64,
            peak_used_bytes: self.rec.c.peak_used as u64,
            peak_total_bytes: self.rec.c.peak_reserved as u64,
            peak_requested_bytes: self.rec.c.peak_requested as u64,
            n_allocs: self.rec.c.allocs + fast_allocs,
            n_frees: self.rec.c.frees + fast_frees,
            n_upstream_allocs: self.rec.c.upstream_allocs,
            n_upstream_frees: self.rec.c.upstream_frees,
            n_ooms: self.rec.c.ooms,
            n_reclaims: self.rec.c.reclaims,
            reclaimed_bytes: self.rec.c.reclaimed_bytes,
            n_invalid_frees: self.rec.c.invalid_frees,
            limit_bytes: self.limits.limit() as u64,
            largest_free_block: self.core.strategy().largest_free_block().max(self.core.deferred_blocks().map(|b| b.size).max().unwrap_or(0))
                as u64,
            device_free_bytes: dev_free as u64,
            device_total_bytes: dev_total as u64,
            n_cross_stream_reuses: self.core.streams().cross_stream_waits + self.core.streams().cross_stream_ready,
            n_deferred_frees: self.rec.c.deferred_frees,
        }
    }

    pub fn memory_status(&mut self) -> String {
        let s = self.stats();
        let mut out = render_status(&self.report_context(), &s);
        out.push_str(&self.status_extras(self.arena_figures().as_ref()));
        out.push_str(&format!("  Driver calls: {}\n", self.core.upstream().driver_calls().text()));
        out
    }

    /// The status report's lines beyond the numbers: a stop, a notice, private pools, the
    /// arena's figures (`arena`: this pool's, or its device's shards added up).
    pub(crate) fn status_extras(&self, arena: Option<&ArenaFigures>) -> String {
        let mut out = String::new();
        if let Some(why) = &self.stopped {
            out.push_str(&format!("  STOPPED: this pool hands out no more memory after an internal error: {why}\n"));
        }
        if let Some(n) = self.core.notice() {
            out.push_str(&format!("  Notice: {n}\n"));
        }
        let (n, reserved, free) = self.private_pool_summary();
        if n > 0 {
            out.push_str(&format!(
                "  Private pools (CUDA graphs, MemPools): {n}, holding {} ({} of it free, kept for their graphs)\n",
                crate::error::human_bytes(reserved),
                crate::error::human_bytes(free)
            ));
        }
        if let Some(a) = arena {
            out.push_str(&a.text());
            out.push('\n');
        }
        let imports = crate::share::imports::count(&self.imports, self.core.upstream());
        if imports > 0 {
            out.push_str(&format!("  IPC: {imports} block(s) of other processes mapped here (gpupool_ipc_open)\n"));
        }
        out
    }

    pub fn stats_json(&mut self) -> String {
        let s = self.stats();
        let mut out = render_json(&self.report_context(), &s);
        out.pop(); // the closing brace: the pool's own fields follow
        out.push_str(&format!(",\"driver_calls\":{}", self.core.upstream().driver_calls().json()));
        out.push_str(&self.json_extras(self.arena_figures().as_ref()));
        out.push('}');
        out
    }

    /// The JSON object's fields beyond the numbers and driver calls, each with its leading
    /// comma: `arena` (`arena`: this pool's, or its device's shards added up), `notice`,
    /// `stopped`, `private_pools`, `ipc_imports` (blocks of other processes open here),
    /// `ipc_imports_kept` (their mappings kept idle for later messages, `import_cache.rs`),
    /// `ipc_import_reuses` (opens served from those) and `ipc_import_address_space` (what
    /// the arena's imports reserve, kept ones included).
    pub(crate) fn json_extras(&self, arena: Option<&ArenaFigures>) -> String {
        let mut out = String::new();
        if let Some(a) = arena {
            out.push_str(&format!(",\"arena\":{}", a.json()));
        }
        if let Some(n) = self.core.notice() {
            out.push_str(&format!(",\"notice\":\"{}\"", n.replace('\\', "\\\\").replace('"', "\\\"")));
        }
        if let Some(why) = &self.stopped {
            out.push_str(&format!(",\"stopped\":\"{}\"", why.replace('\\', "\\\\").replace('"', "\\\"")));
        }
        let (n, reserved, free) = self.private_pool_summary();
        out.push_str(&format!(",\"private_pools\":{{\"count\":{n},\"reserved_bytes\":{reserved},\"free_bytes\":{free}}}"));
        out.push_str(&format!(
            ",\"ipc_imports\":{},\"ipc_imports_kept\":{},\"ipc_import_reuses\":{},\"ipc_import_address_space\":{}",
            crate::share::imports::count(&self.imports, self.core.upstream()),
            self.imports.idle(),
            self.imports.reuses(),
            self.core.upstream().vmm_import_bytes()
        ));
        out
    }

    /// Driver calls made by this pool's upstream so far, by kind.
    pub fn driver_calls(&self) -> crate::upstream::DriverCalls {
        self.core.upstream().driver_calls()
    }

    /// Why the configured strategy is not running, if it is not (arena without VMM).
    pub(crate) fn notice(&self) -> Option<&str> {
        self.core.notice()
    }

    /// Device, strategy and upstream names, as the reports head them.
    pub(crate) fn report_context(&self) -> ReportContext<'static> {
        ReportContext { device: self.core.device(), strategy: self.core.strategy().name(), upstream: self.core.upstream().name() }
    }

    /// Cached free blocks (tests and reports).
    pub fn free_blocks(&self) -> Vec<Block> {
        self.core.strategy().free_blocks()
    }

    /// Full consistency check of the pool and its strategy.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.core.strategy().check_invariants()?;
        self.graphs.check_invariants()?;
        let live_bytes: usize = self.core.live_blocks().map(|l| l.block.size).sum();
        if live_bytes != self.rec.c.used {
            return Err(format!("used {} but live blocks hold {live_bytes}", self.rec.c.used));
        }
        let pending: usize = self.core.deferred_blocks().map(|b| b.size).sum::<usize>()
            + self.graphs.pending_blocks().iter().map(|b| b.size).sum::<usize>()
            + self.core.unfenced_bytes()
            + self.core.unreleased_bytes();
        if self.core.unfenced_bytes() != self.core.unfenced_blocks().map(|b| b.size).sum::<usize>() {
            return Err("unfenced byte count drifted".into());
        }
        let cached = self.core.strategy().cached_bytes() + self.graphs.cached_bytes();
        if self.rec.c.used + cached + pending != self.rec.c.reserved + self.core.holes().bytes() {
            return Err(format!(
                "used {} + cached {} + pending {pending} != reserved {} + decommitted {}",
                self.rec.c.used,
                cached,
                self.rec.c.reserved,
                self.core.holes().bytes()
            ));
        }
        let in_holes = |b: &Block| !self.core.holes().missing_runs(b.segment, b.addr, b.size).is_empty();
        if let Some(l) = self.core.live_blocks().find(|l| in_holes(&l.block)) {
            return Err(format!("live block {:?} overlaps decommitted pages", l.block));
        }
        if let Some(b) = self.core.deferred_blocks().find(|b| in_holes(b)) {
            return Err(format!("deferred block {b:?} overlaps decommitted pages"));
        }
        let mut spans: Vec<(usize, usize, bool)> = self.core.live_blocks().map(|l| (l.block.addr, l.block.end(), true)).collect();
        spans.extend(self.core.strategy().free_blocks().iter().map(|b| (b.addr, b.end(), false)));
        spans.extend(self.graphs.free_blocks().iter().map(|b| (b.addr, b.end(), false)));
        spans.extend(self.graphs.pending_blocks().iter().map(|b| (b.addr, b.end(), true)));
        spans.extend(self.core.deferred_blocks().map(|b| (b.addr, b.end(), true)));
        spans.extend(self.core.unfenced_blocks().map(|b| (b.addr, b.end(), true)));
        spans.sort_unstable();
        for w in spans.windows(2) {
            if w[0].1 > w[1].0 {
                return Err(format!("blocks overlap: {:#x}..{:#x} and {:#x}..{:#x}", w[0].0, w[0].1, w[1].0, w[1].1));
            }
        }
        for l in self.core.live_blocks() {
            if l.block.addr % crate::block::MIN_ALIGN != 0 || l.requested > l.block.size {
                return Err(format!("live block {:?} misaligned or short of {}", l.block, l.requested));
            }
        }
        // A thread cache holds only live blocks recorded as its own (a snapshot: owners
        // change HANDED <-> PARKED concurrently, never the pointer).
        for (id, p, how) in self.caches.held() {
            if !self.core.live(p).is_some_and(|l| l.owner == id) {
                return Err(format!("thread cache {id} holds {p:#x} ({how:?}), which is not its live block"));
            }
        }
        Ok(())
    }

    pub(super) fn verify(&self) {
        if self.rec.check {
            if let Err(e) = self.check_invariants() {
                panic!("gpupool invariant violated on device {}: {e}", self.core.device());
            }
        }
    }
}
