"""Seeing memory: PyTorch-format snapshots of a live pool and of a trace, the SVG timeline,
and the status command for a trace and for a running process (host upstream: runs anywhere)."""
import os
import pathlib
import pickle
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
from conftest import INSTALLED, ROOT, _env, ok, run_py

TRACE = ROOT / "tests" / "data" / "torch_mlp_trace.csv"


def cli(*args, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "gpupool", *args], capture_output=True, text=True, env=_env(env),
                          timeout=120, **kw)


def check_snapshot_books(snap):
    """What PyTorch's _memory_viz.segsum asserts, and block tiling."""
    for seg in snap["segments"]:
        at = seg["address"]
        for b in seg["blocks"]:
            assert b["address"] == at, (seg["address"], b)
            assert b["state"] in ("active_allocated", "active_pending_free", "inactive")
            assert b["requested_size"] <= b["size"]
            at += b["size"]
        assert at == seg["address"] + seg["total_size"], seg
        assert seg["allocated_size"] == sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")


def test_live_snapshot_agrees_with_stats(library):
    out = ok(run_py("""
        import ctypes, gpupool, pickle
        for kind in ("split", "binned", "arena"):
            gpupool.configure(0, pool=kind, upstream="host")
            L = gpupool.lib()
            ps = []
            for i, n in enumerate([1000, 5 << 20, 300 << 10, 12 << 20, 64, 3 << 20]):
                p = ctypes.c_void_p()
                assert L.gpupool_malloc(ctypes.byref(p), n, 0, None) == 0
                ps.append(p)
            for p in ps[::2]:
                assert L.gpupool_free(p, 0, None) == 0
            snap = gpupool.snapshot.snapshot(0)
            s = gpupool.stats(0)
            segs = snap["segments"]
            total = sum(x["total_size"] for x in segs)
            active = sum(b["size"] for x in segs for b in x["blocks"] if b["state"] != "inactive")
            assert total == s["total_bytes"], (kind, total, s["total_bytes"])
            assert active == s["used_bytes"], (kind, active, s["used_bytes"])
            assert pickle.loads(pickle.dumps(snap)) == snap
            print(kind, len(segs), total, active)
            for p in ps[1::2]:
                assert L.gpupool_free(p, 0, None) == 0
            gpupool.reclaim(0)
        import json; print("SNAP", json.dumps(snap))
    """, env={"GPUPOOL_THREAD_CACHE": "0"}))
    import json
    snap = json.loads([line for line in out.splitlines() if line.startswith("SNAP ")][0][5:])
    check_snapshot_books(snap)


def test_trace_snapshot_has_events_and_tiled_segments(tmp_path):
    r = cli("snapshot", str(TRACE), "-o", str(tmp_path / "s.pickle"))
    assert r.returncode == 0, r.stderr
    snap = pickle.loads((tmp_path / "s.pickle").read_bytes())
    actions = {e["action"] for t in snap["device_traces"] for e in t}
    assert {"alloc", "free_requested", "free_completed", "segment_alloc"} <= actions, actions
    check_snapshot_books(snap)
    assert sum(s["total_size"] for s in snap["segments"]) == 112 << 20


def test_pytorch_memory_viz_reads_the_snapshots(tmp_path):
    try:
        from torch.cuda import _memory_viz
    except Exception as e:  # torch missing
        pytest.skip(f"torch is not installed here ({type(e).__name__})")
    assert cli("snapshot", str(TRACE), "-o", str(tmp_path / "s.pickle")).returncode == 0
    snap = pickle.loads((tmp_path / "s.pickle").read_bytes())
    text = _memory_viz.segsum(snap)  # asserts PyTorch's own invariants on the books
    assert "total_reserved: 112.0MiB" in text, text
    assert "entries" in _memory_viz.trace(snap)


def test_plot_writes_an_svg_with_every_series(tmp_path):
    out = tmp_path / "timeline.svg"
    r = cli("plot", str(TRACE), "-o", str(out))
    assert r.returncode == 0, r.stderr
    root = ET.parse(out).getroot()  # well-formed XML
    ns = "{http://www.w3.org/2000/svg}"
    series = {p.get("data-series") for p in root.iter(ns + "polyline")}
    assert {"reserved", "allocated", "stream legacy"} <= series, series
    bands = [r for r in root.iter(ns + "rect") if r.get("class") == "segment"]
    assert len(bands) == 8, len(bands)
    assert "peak reserved 112.0 MiB" in out.read_text()


def test_status_of_a_trace_and_bad_input():
    r = cli("status", str(TRACE))
    assert r.returncode == 0, r.stderr
    assert "peaks: 112.0 MiB reserved, 95.7 MiB allocated, ratio 1.170" in r.stdout, r.stdout
    bad = cli("status", str(ROOT / "README.md"))
    assert bad.returncode != 0 and "not a gpupool trace" in bad.stderr, bad.stderr
    assert cli("status").returncode != 0


SERVER = """
import ctypes, gpupool, sys
gpupool.configure(0, pool="split", upstream="host")
p = ctypes.c_void_p()
assert gpupool.lib().gpupool_malloc(ctypes.byref(p), 3 << 20, 0, None) == 0
print("ready", flush=True)
sys.stdin.readline()
"""


def serving(tmp_path):
    """A process with its status socket on, under XDG_RUNTIME_DIR=tmp_path."""
    return subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=_env({"GPUPOOL_STATUS_SOCKET": "1", "XDG_RUNTIME_DIR": str(tmp_path)}))


def stop(child):
    child.stdin.write("\n")
    child.stdin.close()
    child.wait(timeout=30)
    return child.stderr.read()


def test_status_of_a_running_process(library, tmp_path):
    tmp_path.chmod(0o700)
    child = serving(tmp_path)
    try:
        assert child.stdout.readline().strip() == "ready"
        sock = tmp_path / "gpupool" / f"{child.pid}.sock"
        assert (sock.parent.stat().st_mode & 0o777, sock.stat().st_mode & 0o777) == (0o700, 0o600)
        r = cli("status", "--pid", str(child.pid), env={"XDG_RUNTIME_DIR": str(tmp_path)})
        assert r.returncode == 0, r.stderr
        assert "3.00 MiB in use" in r.stdout, r.stdout
    finally:
        stop(child)
    gone = cli("status", "--pid", str(child.pid), env={"XDG_RUNTIME_DIR": str(tmp_path)})
    assert gone.returncode != 0 and "GPUPOOL_STATUS_SOCKET=1" in gone.stderr


def test_status_socket_refuses_a_place_another_user_prepared(library, tmp_path):
    """Someone who makes the socket's directory first (another user, or a directory open to
    all) keeps the socket off, with the reason on stderr, instead of receiving it."""
    squat = tmp_path / "gpupool"
    squat.mkdir()
    if os.geteuid() == 0:
        os.chown(squat, 65534, 65534)
        why = "belongs to uid 65534, not to this user"
    else:
        squat.chmod(0o777)
        why = "is open to other users (mode 777)"
    child = serving(tmp_path)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert not (squat / f"{child.pid}.sock").exists()
    finally:
        err = stop(child)
    assert "the status socket is off" in err and why in err, err


def test_status_reader_refuses_an_answer_from_another_process(library, tmp_path):
    """A socket at process P's place served by someone else: the reader checks the peer's
    credentials and does not print what it says."""
    import socket
    import threading

    (tmp_path / "gpupool").mkdir(mode=0o700)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(str(tmp_path / "gpupool" / f"{other.pid}.sock"))
        srv.listen(1)

        def answer():
            c, _ = srv.accept()
            try:
                c.sendall(b"forged report: 0 bytes in use\n")
            except OSError:  # the reader hung up unanswered, as it should
                pass
            c.close()

        t = threading.Thread(target=answer, daemon=True)
        t.start()
        r = cli("status", "--pid", str(other.pid), env={"XDG_RUNTIME_DIR": str(tmp_path)})
        assert r.returncode != 0 and "forged" not in r.stdout, (r.stdout, r.stderr)
        assert f"served by process {os.getpid()}" in r.stderr and f"not by process {other.pid}" in r.stderr, r.stderr
    finally:
        other.kill()
        other.wait()


def test_status_socket_answers_no_other_user(library):
    """The server checks the reader's credentials: another user who reaches the socket (its
    directory opened after the start, as a misconfigured host might) gets no report."""
    import shutil
    import tempfile

    if os.geteuid() != 0:
        pytest.skip("needs root to connect as another user")
    tmp_path = pathlib.Path(tempfile.mkdtemp(prefix="gpupool-status-"))  # under /tmp: others can reach it
    child = serving(tmp_path)
    try:
        assert child.stdout.readline().strip() == "ready"
        sock = tmp_path / "gpupool" / f"{child.pid}.sock"
        for p in (tmp_path, sock.parent, sock):
            p.chmod(0o777)
        r = subprocess.run([sys.executable, "-c", f"""
import os, socket
os.setgid(65534); os.setuid(65534)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
s.connect({str(sock)!r})
print("got", len(s.recv(65536)))
"""], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout.strip() == "got 0", (r.stdout, r.stderr)
        tmp_path.chmod(0o700)  # private again: the reader looks there only then
        same = cli("status", "--pid", str(child.pid), env={"XDG_RUNTIME_DIR": str(tmp_path)})
        assert same.returncode == 0 and "3.00 MiB in use" in same.stdout, same.stderr
    finally:
        stop(child)
        shutil.rmtree(tmp_path)


@pytest.mark.parametrize("kind", ["split", "binned", "arena"])
@pytest.mark.parametrize("end", ["reclaimed", "held"])
def test_status_and_snapshot_of_a_trace_agree_on_segments(library, tmp_path, kind, end):
    """`status TRACE` and `snapshot TRACE` count the same segments held at the end, and the
    snapshot's bytes are the pool's: a trace that ends with everything freed and reclaimed
    (its last event an upstream_free) holds none; the arena unmaps granule by granule, in
    ranges that are not the ones it mapped."""
    trace = tmp_path / "trace.csv"
    out = ok(run_py(f"""
        import ctypes, gpupool
        gpupool.configure(0, pool="{kind}", upstream="host")
        L = gpupool.lib()
        ps = []
        for n in [1000, 5 << 20, 300 << 10, 12 << 20, 64, 3 << 20, 40 << 20]:
            p = ctypes.c_void_p()
            assert L.gpupool_malloc(ctypes.byref(p), n, 0, None) == 0
            ps.append(p)
        for p in ps[::2]:
            assert L.gpupool_free(p, 0, None) == 0
        if "{end}" == "reclaimed":
            for p in ps[1::2]:
                assert L.gpupool_free(p, 0, None) == 0
            gpupool.reclaim(0)
        print("TOTAL", gpupool.stats(0)["total_bytes"])
    """, env={"GPUPOOL_TRACE": str(trace), "GPUPOOL_THREAD_CACHE": "0"}))
    total = int(out.split("TOTAL ")[1].split()[0])
    assert (total == 0) == (end == "reclaimed"), out
    st = cli("status", str(trace))
    assert st.returncode == 0, st.stderr
    held = int(st.stdout.split(" segment(s) held")[0].rsplit(" ", 1)[1])
    sn = cli("snapshot", str(trace), "-o", str(tmp_path / "s.pickle"))
    assert sn.returncode == 0, sn.stderr
    snap = pickle.loads((tmp_path / "s.pickle").read_bytes())
    check_snapshot_books(snap)
    assert f"{len(snap['segments'])} segment(s)" in sn.stdout, sn.stdout
    assert held == len(snap["segments"]), (st.stdout, sn.stdout)
    assert sum(s["total_size"] for s in snap["segments"]) == total, (snap["segments"], total)
    assert (held == 0) == (end == "reclaimed"), st.stdout


def test_usage_names_the_command_as_invoked(tmp_path):
    """`python -m gpupool` says so in its usage line; the `gpupool` console script says
    `gpupool` (a script like the one pip writes stands in for it in the source tree; the
    installed one is run too when testing the installed wheel)."""
    r = cli("status")
    assert r.returncode != 0 and "usage: python -m gpupool " in r.stderr, r.stderr
    script = tmp_path / "gpupool"
    script.write_text(f"#!{sys.executable}\nimport sys\nfrom gpupool.__main__ import main\nsys.exit(main())\n")
    script.chmod(0o755)
    scripts = [script]
    installed = pathlib.Path(sys.executable).parent / "gpupool"
    if INSTALLED and installed.is_file():
        scripts.append(installed)
    e = dict(os.environ)
    if not INSTALLED:
        e["PYTHONPATH"] = str(ROOT / "python") + os.pathsep + e.get("PYTHONPATH", "")
    for s in scripts:
        r = subprocess.run([str(s), "status"], capture_output=True, text=True, env=e, timeout=120)
        assert r.returncode != 0, (s, r.stdout)
        assert "usage: gpupool " in r.stderr and "python -m" not in r.stderr, (s, r.stderr)


@pytest.mark.parametrize("cmd,words", [("status", "GPUPOOL_STATUS_SOCKET=1"), ("plot", "SVG image"),
                                       ("snapshot", "memory_viz"), ("build-torch", "extension cache")])
def test_every_command_says_what_it_does(cmd, words):
    r = cli(cmd, "-h")
    assert r.returncode == 0 and words in " ".join(r.stdout.split()), r.stdout
