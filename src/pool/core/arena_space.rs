//! The arena's address space, reserved when its pool's core is built: the ranges the
//! `arena` strategy places blocks in (`pool/grow.rs` makes the driver calls that map them).

use crate::pool::options::PoolOptions;
use crate::strategy::arena::ArenaStrategy;
use crate::upstream::Upstream;

/// Build the arena over address space reserved from `up`, or say why not (the caller falls
/// back to `split` and shows the reason in the status report). Every shard of a device
/// (`crate::registry`) builds its own, over its own ranges.
///
/// Address space, in multiples of the device's memory `M`: the large range gets `2M` (room
/// for the unmapped holes releases leave between live blocks), the small range `M`, the
/// stitch range as much as the large one (at most all of it is stitched at once). A stream
/// shard reserves as much as shard 0: one stream may hold most of the device, and a range
/// that runs out fails requests the device could serve. A device with all 16 stream shards
/// in use holds `85M` of address space, a small part of the 128 TiB a process has.
/// `opts` gives the address space (`arena_va`), the chunk sizes and piece ends.
pub(in crate::pool) fn build(up: &mut dyn Upstream, opts: &PoolOptions) -> std::result::Result<Box<ArenaStrategy>, String> {
    let va_bytes = opts.arena_va;
    let mut g = up.vmm_granule();
    if g == 0 {
        return Err(format!("arena unavailable: the {} upstream or its device has no virtual memory management; using split", up.name()));
    }
    if opts.arena_granule > g {
        g = up.vmm_set_granule(opts.arena_granule);
    }
    let total = up.mem_info().map(|m| m.1).unwrap_or(0).max(g);
    let round = |n: usize| n.div_ceil(g) * g;
    let mut large = round(va_bytes.unwrap_or(total.saturating_mul(2)));
    let small = round(total.min(large));
    let small_base = up.vmm_reserve(small).map_err(|e| format!("arena unavailable: reserving address space failed ({e}); using split"))?;
    loop {
        let reserved = up.vmm_reserve(large).and_then(|b| match up.vmm_reserve(large) {
            Ok(s) => Ok((b, s)),
            Err(e) => {
                let _ = up.vmm_unreserve(b, large);
                Err(e)
            }
        });
        match reserved {
            Ok((base, stitch)) => {
                let mut a = ArenaStrategy::new((small_base, small), (base, large), (stitch, large), g);
                a.set_chunks(opts.arena_chunk, opts.arena_chunk_from);
                a.set_device_bytes(total);
                a.set_piece_ends(opts.arena_piece_ends);
                return Ok(Box::new(a));
            }
            Err(e) if large <= total / 2 || va_bytes.is_some() => {
                let _ = up.vmm_unreserve(small_base, small);
                return Err(format!("arena unavailable: reserving {large} bytes of address space failed ({e}); using split"));
            }
            Err(_) => large = round(large / 2),
        }
    }
}
