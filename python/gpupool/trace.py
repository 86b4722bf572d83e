"""Reading a GPUPOOL_TRACE file (CSV: time_ns,thread,device,stream,action,ptr,size)."""

import csv
from collections import namedtuple

Row = namedtuple("Row", "time_ns thread device stream action ptr size")


def read(path):
    """Every row of the trace, in file order (which is time order per thread)."""
    with open(path, newline="") as f:
        r = csv.reader(f)
        header = next(r, None)
        if header != list(Row._fields):
            raise ValueError(f"{path}: not a gpupool trace (header {header!r}, expected {','.join(Row._fields)})")
        rows = []
        for n, rec in enumerate(r, start=2):
            try:
                rows.append(Row(int(rec[0]), int(rec[1]), int(rec[2]), int(rec[3], 16), rec[4], int(rec[5], 16), int(rec[6])))
            except (ValueError, IndexError) as e:
                raise ValueError(f"{path}:{n}: malformed row {rec!r}: {e}") from None
    rows.sort(key=lambda row: row.time_ns)
    return rows


def held_segments(rows):
    """The memory held from the upstream at the end of the trace, as segments: a sorted list
    of (device, base, size, stream). `status TRACE` counts these and `snapshot TRACE` draws
    them, so the two agree.

    Only `upstream_alloc` and `upstream_free` map and unmap memory (`page_commit` and
    `page_decommit` back pages again or give them back inside a segment that stays). An
    `upstream_free` takes away the bytes it names wherever they lie (the arena maps granule
    runs and unmaps them granule by granule), and contiguous ranges of a device form one
    segment (the arena maps runs side by side), keeping the first range's stream."""
    held = {}  # device -> {base: [size, stream]}, non-overlapping
    for r in rows:
        if r.action == "upstream_alloc":
            held.setdefault(r.device, {})[r.ptr] = [r.size, r.stream]
        elif r.action == "upstream_free":
            ranges = held.get(r.device, {})
            lo, hi = r.ptr, r.ptr + r.size
            for base, (size, stream) in list(ranges.items()):
                end = base + size
                if end <= lo or base >= hi:
                    continue
                del ranges[base]
                if base < lo:
                    ranges[base] = [lo - base, stream]
                if end > hi:
                    ranges[hi] = [end - hi, stream]
    out = []
    for d in sorted(held):
        for base, (size, stream) in sorted(held[d].items()):
            if out and out[-1][0] == d and out[-1][1] + out[-1][2] == base:
                out[-1][2] += size
            else:
                out.append([d, base, size, stream])
    return [tuple(s) for s in out]
