"""Memory snapshots in PyTorch's format (`torch.cuda.memory._snapshot()`), so that PyTorch's
memory visualizer (pytorch.org/memory_viz) and `torch.cuda._memory_viz` read memory from any
framework using gpupool, CuPy and C included:

    gpupool.snapshot.dump("snap.pickle")               # this process's pools, now
    python -m gpupool snapshot TRACE.csv -o snap.pickle  # a GPUPOOL_TRACE file: its events,
                                                         # and the memory at its end

A snapshot is a dict: `segments` (each with `blocks`: `active_allocated`,
`active_pending_free`, `inactive`) and `device_traces` (per device, the events: `alloc`,
`free_requested`, `free_completed`, `segment_alloc`, `segment_free`, `oom`). gpupool records
no stack frames: `frames` are empty lists.
"""

import json
import pickle

from . import _text, lib


def _segment(device, seg):
    blocks = [dict(address=b["address"], size=b["size"], requested_size=b["requested_size"], state=b["state"], frames=[])
              for b in seg["blocks"]]
    active = sum(b["size"] for b in blocks if b["state"] != "inactive")
    allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    requested = sum(b["requested_size"] for b in blocks if b["state"] == "active_allocated")
    return dict(device=device, address=seg["address"], total_size=seg["total_size"], allocated_size=allocated,
                active_size=active, requested_size=requested, stream=seg["stream"],
                segment_type="small" if seg["total_size"] <= (2 << 20) else "large",
                segment_pool_id=tuple(seg.get("pool_id", (0, 0))), is_expandable=bool(seg.get("is_expandable")),
                frames=[], blocks=blocks)


def snapshot(device=-1):
    """This process's pool(s) now, as PyTorch's snapshot dict (device -1: every device in use)."""
    data = json.loads(_text(lib().gpupool_snapshot_json, device))
    pools = data if isinstance(data, list) else [data]
    segments = [_segment(p["device"], s) for p in pools for s in p["segments"]]
    ndev = max([p["device"] for p in pools] + [-1]) + 1
    return {"segments": segments, "device_traces": [[] for _ in range(ndev)],
            "allocator_settings": {"gpupool_strategy": ",".join(sorted({p["strategy"] for p in pools}))}}


def from_trace(path):
    """A GPUPOOL_TRACE file as PyTorch's snapshot dict: every event in `device_traces`, and
    the segments and blocks live at the end of the trace."""
    from .trace import held_segments, read
    rows = read(path)
    traces = {}
    live = {}    # (device, ptr) -> (size, stream)
    for r in rows:
        t = traces.setdefault(r.device, [])
        ev = dict(addr=r.ptr, size=r.size, stream=r.stream, time_us=r.time_ns // 1000, frames=[])
        if r.action == "alloc":
            t.append(dict(ev, action="alloc"))
            live[(r.device, r.ptr)] = (r.size, r.stream)
        elif r.action == "free":
            t.append(dict(ev, action="free_requested"))
            t.append(dict(ev, action="free_completed"))
            live.pop((r.device, r.ptr), None)
        elif r.action in ("upstream_alloc", "page_commit"):
            t.append(dict(ev, action="segment_alloc" if r.action == "upstream_alloc" else "segment_map"))
        elif r.action in ("upstream_free", "page_decommit"):
            t.append(dict(ev, action="segment_free" if r.action == "upstream_free" else "segment_unmap"))
        elif r.action == "oom":
            t.append(dict(ev, action="oom", device_free=0))
    # The segments held at the end (contiguous mappings form one: the arena maps granule
    # runs side by side), computed as `status TRACE` counts them.
    segs = {(d, base): (size, stream) for d, base, size, stream in held_segments(rows)}
    segments = []
    by_device = {}
    for (d, p), (size, stream) in live.items():
        by_device.setdefault(d, []).append((p, size, stream))
    for (d, base), (size, stream) in sorted(segs.items()):
        inside = sorted(x for x in by_device.get(d, []) if base <= x[0] < base + size)
        blocks, at = [], base
        for p, n, _ in inside:
            if p < at:
                continue  # overlaps the previous block: the trace missed a free; keep the books whole
            if p > at:
                blocks.append(dict(address=at, size=p - at, requested_size=p - at, state="inactive"))
            # The trace has requested sizes; the block is shown as requested (rounding unknown).
            n = min(n, base + size - p)
            blocks.append(dict(address=p, size=n, requested_size=n, state="active_allocated"))
            at = p + n
        if at < base + size:
            blocks.append(dict(address=at, size=base + size - at, requested_size=base + size - at, state="inactive"))
        segments.append(_segment(d, dict(address=base, total_size=size, stream=stream, blocks=blocks)))
    ndev = max(list(traces) + [-1]) + 1
    return {"segments": segments, "device_traces": [traces.get(d, []) for d in range(ndev)],
            "allocator_settings": {"source": "gpupool trace " + str(path)}}


def dump(path, data=None):
    """Pickle `data` (default: `snapshot()`) to `path`, as `torch.cuda.memory._dump_snapshot` does."""
    with open(path, "wb") as f:
        pickle.dump(snapshot() if data is None else data, f)
    return path
