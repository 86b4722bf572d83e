"""`python -m gpupool COMMAND` (also installed as the `gpupool` command):

  status --pid PID           the status report of a running process's pools (that process
                             must run with GPUPOOL_STATUS_SOCKET=1)
  status TRACE.csv           the state at the end of a GPUPOOL_TRACE file, and its peaks
  plot TRACE.csv -o OUT.svg  memory over time (reserved, allocated, per stream; segments as bands)
  snapshot TRACE.csv -o OUT.pickle
                             the trace in PyTorch's memory snapshot format (for
                             pytorch.org/memory_viz and torch.cuda._memory_viz)
  build-torch                compile gpupool's PyTorch allocator against the installed
                             PyTorch now (into PyTorch's extension cache), so that later
                             processes load it without a compiler
"""

import argparse
import os
import socket
import struct
import sys


def _status_of_pid(pid):
    from . import _socket_path
    path = _socket_path(pid)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    try:
        s.connect(path)
    except OSError as e:
        raise SystemExit(f"gpupool: cannot reach process {pid}'s status socket {path}: {e.strerror or e}\n"
                         "(start that process with GPUPOOL_STATUS_SOCKET=1)")
    # Whoever answers must be the process asked for, of this user (root reads anyone's): a
    # socket in that place from anyone else is not its report (Note [The status socket]).
    peer_pid, peer_uid, _ = struct.unpack("iII", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              struct.calcsize("iII")))
    if peer_pid != pid or (peer_uid != os.geteuid() and os.geteuid() != 0):
        raise SystemExit(f"gpupool: {path} is served by process {peer_pid} of uid {peer_uid}, not by process {pid} "
                         f"of this user (uid {os.geteuid()}): its answer is not read")
    chunks = []
    while True:
        b = s.recv(65536)
        if not b:
            break
        chunks.append(b)
    if not chunks:
        raise SystemExit(f"gpupool: process {pid} closed its status socket without a report (it answers only "
                         "its own user and root)")
    return b"".join(chunks).decode(errors="replace")


def _status_of_trace(path):
    from .plot import _human, series
    from .trace import held_segments, read
    rows = read(path)
    times, reserved, allocated, per_stream, _ = series(rows)
    if not times:
        return f"{path}: no memory events\n"
    counts = {}
    for r in rows:
        counts[r.action] = counts.get(r.action, 0) + 1
    held = held_segments(rows)  # what `snapshot TRACE` draws as segments
    peak_r, peak_a = max(reserved), max(allocated)
    lines = [
        f"gpupool trace {path}: {len(rows)} events over {(times[-1] - times[0]) / 1e9:.3f} s",
        f"  at the end: {_human(reserved[-1])} reserved, {_human(allocated[-1])} allocated, "
        f"{len(held)} segment(s) held",
        f"  peaks: {_human(peak_r)} reserved, {_human(peak_a)} allocated"
        + (f", ratio {peak_r / peak_a:.3f} (peak reserved / peak allocated)" if peak_a else ""),
        "  events: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
    ]
    for s, vals in sorted(per_stream.items()):
        name = "legacy" if s in (0, 1) else f"{s:#x}"
        lines.append(f"  stream {name}: {_human(vals[-1])} allocated at the end, peak {_human(max(vals))}")
    return "\n".join(lines) + "\n"


def _prog():
    """The name this was invoked by, for the usage line: `python -m gpupool`, or the console
    script's own name (`gpupool`, or the path it was started by)."""
    arg0 = sys.argv[0] if sys.argv and sys.argv[0] else ""
    if not arg0 or os.path.basename(arg0) in ("__main__.py", "-c", "-m"):
        return "python -m gpupool"
    return os.path.basename(arg0)


def main(argv=None):
    ap = argparse.ArgumentParser(prog=_prog(), description="gpupool tools")
    from . import __version__
    ap.add_argument("--version", action="version", version=f"gpupool {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("status", help="status report of a running process (--pid) or of a trace",
                        description="The status report of a running process's pools (it must run with "
                                    "GPUPOOL_STATUS_SOCKET=1, as the same user), or the state at the end of a "
                                    "GPUPOOL_TRACE file and its peaks. Give exactly one of --pid and TRACE.")
    st.add_argument("trace", nargs="?", metavar="TRACE", help="a GPUPOOL_TRACE CSV file")
    st.add_argument("--pid", type=int, help="the process to ask")
    pl = sub.add_parser("plot", help="memory over time from a trace, as SVG",
                        description="Reserved and allocated memory over time, per stream, with segments as "
                                    "bands, from a GPUPOOL_TRACE file, as an SVG image.")
    pl.add_argument("trace", metavar="TRACE", help="a GPUPOOL_TRACE CSV file")
    pl.add_argument("-o", "--output", default="timeline.svg", help="the SVG to write (default: %(default)s)")
    pl.add_argument("--title", help="the image's title (default: the trace's name)")
    sn = sub.add_parser("snapshot", help="a trace in PyTorch's memory snapshot format (pickle)",
                        description="A GPUPOOL_TRACE file as a PyTorch memory snapshot (its events and the "
                                    "memory at the end), for pytorch.org/memory_viz and torch.cuda._memory_viz.")
    sn.add_argument("trace", metavar="TRACE", help="a GPUPOOL_TRACE CSV file")
    sn.add_argument("-o", "--output", default="snapshot.pickle", help="the pickle to write (default: %(default)s)")
    sub.add_parser("build-torch", help="compile the PyTorch allocator class for the installed PyTorch",
                   description="Compile gpupool's PyTorch allocator class against the installed PyTorch now, "
                               "into PyTorch's extension cache, so that later processes load it without a "
                               "compiler (for images whose first process should not compile). Needs a C++ "
                               "compiler, ninja and the CUDA runtime's headers.")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "status":
            if (a.pid is None) == (a.trace is None):
                ap.error("status needs exactly one of --pid PID or TRACE")
            sys.stdout.write(_status_of_pid(a.pid) if a.pid is not None else _status_of_trace(a.trace))
        elif a.cmd == "plot":
            from .plot import plot
            print(f"wrote {plot(a.trace, a.output, a.title)}")
        elif a.cmd == "snapshot":
            from .snapshot import dump, from_trace
            data = from_trace(a.trace)
            dump(a.output, data)
            n = sum(len(t) for t in data["device_traces"])
            print(f"wrote {a.output}: {len(data['segments'])} segment(s), {n} trace event(s)")
        elif a.cmd == "build-torch":
            from ._torch_allocator import build
            try:
                print(f"built {build()}")
            except RuntimeError as e:
                raise SystemExit(f"gpupool: {e}")
    except (OSError, ValueError) as e:
        raise SystemExit(f"gpupool: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
