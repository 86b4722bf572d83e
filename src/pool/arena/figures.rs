//! What the reports say of an arena pool (`ArenaFigures`): its mapped memory, address
//! space, stitches, loans and counters, added up over a device's shards, as JSON and as a
//! line of the status report.

use crate::pool::core::Core;
use crate::strategy::arena::ArenaCounters;

/// What the reports say of an arena: one pool's figures, or a device's shards added up
/// (`add`), so a device whose streams allocate on several shards reports all of them.
#[derive(Clone, Debug, Default)]
pub struct ArenaFigures {
    pub granule: usize,
    /// Bytes of memory mapped, and address space reserved.
    pub mapped: usize,
    pub address_space: usize,
    /// Stitches cached now.
    pub stitches: usize,
    /// Chunks mapped now and their bytes: memory the arena stitches, releases and exports
    /// only whole (`GPUPOOL_ARENA_CHUNK_FROM`, `GPUPOOL_ARENA_CHUNK`).
    pub chunks: (usize, usize),
    pub counters: ArenaCounters,
    /// (mapped, free) bytes of the small and of the large range: where the mapped memory
    /// that serves nothing lies.
    pub small: (usize, usize),
    pub large: (usize, usize),
    /// What its granules are created as (`VirtualMemory::vmm_memory_kind`).
    pub memory: String,
    /// Bytes of granules unmapped whose memory the driver would not release (lost until
    /// the process ends).
    pub leaked: usize,
}

impl ArenaFigures {
    /// The figures of `core`'s arena (`None` for other pools).
    pub(in crate::pool) fn of(core: &Core) -> Option<ArenaFigures> {
        let a = core.arena()?;
        let usage = a.space_usage();
        Some(ArenaFigures {
            granule: a.granule(),
            mapped: a.mapped_bytes(),
            address_space: a.reserved_address_space(),
            stitches: a.stitch_count(),
            chunks: a.chunk_usage(),
            counters: a.counters,
            small: usage[0],
            large: usage[1],
            memory: core.upstream().vmm_memory_kind(),
            leaked: core.arena_leaked(),
        })
    }

    /// Add another shard's arena.
    pub fn add(&mut self, o: &ArenaFigures) {
        self.granule = self.granule.max(o.granule);
        self.mapped += o.mapped;
        self.address_space += o.address_space;
        self.stitches += o.stitches;
        self.chunks = (self.chunks.0 + o.chunks.0, self.chunks.1 + o.chunks.1);
        let (c, d) = (&mut self.counters, &o.counters);
        c.granules_mapped += d.granules_mapped;
        c.granules_unmapped += d.granules_unmapped;
        c.stitches_made += d.stitches_made;
        c.stitch_reuses += d.stitch_reuses;
        c.stitches_dropped += d.stitches_dropped;
        c.granules_aliased += d.granules_aliased;
        c.stitch_pieces += d.stitch_pieces;
        c.granules_lent += d.granules_lent;
        c.loans_ended += d.loans_ended;
        self.small = (self.small.0 + o.small.0, self.small.1 + o.small.1);
        self.large = (self.large.0 + o.large.0, self.large.1 + o.large.1);
        if self.memory.is_empty() {
            self.memory.clone_from(&o.memory);
        }
        self.leaked += o.leaked;
    }

    /// The `arena` object of the JSON report.
    pub fn json(&self) -> String {
        let c = self.counters;
        format!(
            concat!(
                "{{\"granule\":{},\"mapped_bytes\":{},\"reserved_address_space\":{},\"granules_mapped\":{},",
                "\"granules_unmapped\":{},\"stitches\":{},\"stitches_made\":{},\"stitch_reuses\":{},",
                "\"stitches_dropped\":{},\"granules_aliased\":{},\"stitch_pieces\":{},\"granules_lent\":{},\"loans_ended\":{},",
                "\"small_mapped_bytes\":{},\"small_free_bytes\":{},\"large_mapped_bytes\":{},\"large_free_bytes\":{},",
                "\"chunks\":{},\"chunk_bytes\":{},\"memory\":\"{}\",\"leaked_bytes\":{}}}"
            ),
            self.granule,
            self.mapped,
            self.address_space,
            c.granules_mapped,
            c.granules_unmapped,
            self.stitches,
            c.stitches_made,
            c.stitch_reuses,
            c.stitches_dropped,
            c.granules_aliased,
            c.stitch_pieces,
            c.granules_lent,
            c.loans_ended,
            self.small.0,
            self.small.1,
            self.large.0,
            self.large.1,
            self.chunks.0,
            self.chunks.1,
            self.memory,
            self.leaked
        )
    }

    /// The arena's line of the status report.
    pub fn text(&self) -> String {
        let (c, h, g) = (self.counters, crate::error::human_bytes, self.granule.max(1));
        format!(
            "  Arena: {} mapped in {} granules of {}, {} of address space; granules mapped {}, unmapped {}, lent between the ranges now {}; stitches {} cached, {} made, {} reused, {} dropped; small range {} mapped, {} free; large range {} mapped, {} free, {} of it in {} chunks; granules created as {}",
            h(self.mapped),
            self.mapped / g,
            h(g),
            h(self.address_space),
            c.granules_mapped,
            c.granules_unmapped,
            c.granules_lent - c.loans_ended,
            self.stitches,
            c.stitches_made,
            c.stitch_reuses,
            c.stitches_dropped,
            h(self.small.0),
            h(self.small.1),
            h(self.large.0),
            h(self.large.1),
            h(self.chunks.1),
            self.chunks.0,
            if self.memory.is_empty() { "plain memory" } else { &self.memory }
        ) + &if self.leaked > 0 {
            format!("; {} unmapped whose memory the driver would not release (leaked)", h(self.leaked))
        } else {
            String::new()
        }
    }
}
