"""`python -m gpupool plot TRACE -o timeline.svg`: memory over time from a GPUPOOL_TRACE
file, as a self-contained SVG (no plotting library needed).

Top panel: reserved bytes (what the pool holds from the driver), allocated bytes (what its
users hold) and allocated bytes per stream (where the memory went). Bottom panel: each
upstream segment as a band from its allocation to its release, so fragmentation and
growth show as bands that stay.
"""

from html import escape

from .trace import read

W, H_TOP, H_BANDS, M = 1100, 380, 220, 70
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]


def _human(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def series(rows):
    """(times, reserved, allocated, {stream: allocated}, segments [(t0, t1, base, size)])."""
    times, reserved, allocated = [], [], []
    per_stream = {}
    live, res, alloc, by_stream = {}, 0, 0, {}
    open_segs, segments = {}, []
    for r in rows:
        if r.action == "alloc":
            live[(r.device, r.ptr)] = (r.size, r.stream)
            alloc += r.size
            by_stream[r.stream] = by_stream.get(r.stream, 0) + r.size
        elif r.action == "free":
            size, stream = live.pop((r.device, r.ptr), (0, r.stream))
            alloc -= size
            by_stream[stream] = by_stream.get(stream, 0) - size
        elif r.action in ("upstream_alloc", "page_commit"):
            res += r.size
            if r.action == "upstream_alloc":
                open_segs[(r.device, r.ptr)] = (r.time_ns, r.size)
        elif r.action in ("upstream_free", "page_decommit"):
            res -= r.size
            if r.action == "upstream_free" and (r.device, r.ptr) in open_segs:
                t0, size = open_segs.pop((r.device, r.ptr))
                segments.append((t0, r.time_ns, r.ptr, size))
        else:
            continue
        times.append(r.time_ns)
        reserved.append(res)
        allocated.append(alloc)
        for s in by_stream:
            per_stream.setdefault(s, [0] * (len(times) - 1)).append(by_stream[s])
        for s, v in per_stream.items():
            if len(v) < len(times):
                v.append(v[-1] if v else 0)
    end = times[-1] if times else 0
    segments += [(t0, None, base, size) for (_, base), (t0, size) in open_segs.items()]
    segments = [(t0, end if t1 is None else t1, base, size) for t0, t1, base, size in segments]
    return times, reserved, allocated, per_stream, segments


def svg(path, title=None):
    """The SVG text for the trace at `path`."""
    rows = read(path)
    times, reserved, allocated, per_stream, segments = series(rows)
    if not times:
        raise ValueError(f"{path}: the trace has no memory events")
    t0, t1 = times[0], max(times[-1], times[0] + 1)
    top = max(max(reserved), max(allocated), 1)
    x = lambda t: M + (t - t0) / (t1 - t0) * (W - 2 * M)
    y = lambda v: M / 2 + H_TOP - v / top * H_TOP

    def line(values, color, name, width=2.0, dash=""):
        pts = []
        for i, (t, v) in enumerate(zip(times, values)):
            if i:
                pts.append(f"{x(t):.1f},{y(values[i - 1]):.1f}")  # a step: the value holds until the event
            pts.append(f"{x(t):.1f},{y(v):.1f}")
        d = f' stroke-dasharray="{dash}"' if dash else ""
        return (f'<polyline class="series" data-series="{escape(name)}" fill="none" stroke="{color}" '
                f'stroke-width="{width}"{d} points="{" ".join(pts)}"/>')

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{int(M * 1.5 + H_TOP + H_BANDS + 40)}" '
           f'font-family="sans-serif" font-size="12">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{M}" y="20" font-size="15" font-weight="bold">{escape(title or "gpupool memory over time: " + str(path))}</text>']
    for i in range(5):  # y grid
        v = top * i / 4
        out.append(f'<line x1="{M}" x2="{W - M}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{M - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{_human(v)}</text>')
    for i in range(6):  # x axis
        t = t0 + (t1 - t0) * i / 5
        out.append(f'<text x="{x(t):.1f}" y="{M / 2 + H_TOP + 16:.1f}" text-anchor="middle">{(t - t0) / 1e9:.3g} s</text>')
    out.append(line(reserved, "#000000", "reserved", 2.5))
    out.append(line(allocated, "#ff7f0e", "allocated", 2.0))
    for i, (s, vals) in enumerate(sorted(per_stream.items())):
        name = "stream legacy" if s in (0, 1) else f"stream {s:#x}"
        out.append(line(vals, COLORS[i % len(COLORS)], name, 1.2, "4 2"))
    legend = [("reserved", "#000000"), ("allocated", "#ff7f0e")] + [
        ("stream legacy" if s in (0, 1) else f"stream {s:#x}", COLORS[i % len(COLORS)]) for i, s in enumerate(sorted(per_stream))]
    for i, (name, color) in enumerate(legend[:12]):
        lx = M + 10 + (i % 4) * 240
        ly = M / 2 + 14 + (i // 4) * 16
        out.append(f'<rect x="{lx}" y="{ly - 9}" width="14" height="4" fill="{color}"/>'
                   f'<text x="{lx + 20}" y="{ly - 4}">{escape(name)}</text>')
    # Segment bands: one row per segment in order of allocation, height by size (min 2 px).
    base_y = M / 2 + H_TOP + 40
    out.append(f'<text x="{M}" y="{base_y - 6:.1f}" font-weight="bold">segments (upstream allocations), '
               f'{len(segments)} in all, band height ~ size</text>')
    total = sum(s[3] for s in segments) or 1
    scale = min(H_BANDS / total, 40 / max(s[3] for s in segments)) if segments else 1
    yy = base_y
    for i, (a, b, base, size) in enumerate(sorted(segments)):
        h = max(size * scale, 2)
        if yy + h > base_y + H_BANDS:
            out.append(f'<text x="{M}" y="{yy + 10:.1f}">... {len(segments) - i} more segments</text>')
            break
        out.append(f'<rect class="segment" x="{x(a):.1f}" y="{yy:.1f}" width="{max(x(b) - x(a), 1):.1f}" height="{h:.1f}" '
                   f'fill="{COLORS[i % len(COLORS)]}" fill-opacity="0.55"><title>{base:#x}: {_human(size)}</title></rect>')
        yy += h + 1
    out.append(f'<text x="{W - M}" y="20" text-anchor="end">peak reserved {_human(max(reserved))}, '
               f'peak allocated {_human(max(allocated))}</text>')
    out.append("</svg>")
    return "\n".join(out)


def plot(path, out_path, title=None):
    text = svg(path, title)
    with open(out_path, "w") as f:
        f.write(text)
    return out_path
