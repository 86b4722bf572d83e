"""bench/workloads/replay_draws.py: every recorded draw of the workload benchmark replayed on the CPU.
Its generated churn draws must be the benchmark's own: draw 0 replays exactly as the GPU's
recording of that draw does (tests/data/draws/churn.csv.xz)."""
import lzma
import re
import subprocess
import sys

import pytest
from conftest import ROOT

REPLAY = ROOT / "target" / "release" / "gpupool-replay"
SCRIPT = ROOT / "bench" / "workloads" / "replay_draws.py"

pytestmark = pytest.mark.skipif(not REPLAY.is_file(), reason="needs target/release/gpupool-replay (cargo build --release)")


def test_every_draw_replays_and_churn_draw_0_is_the_recorded_one(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "--replay", str(REPLAY)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = re.findall(r"^\| (tokens|training|serving|churn) \| (\d+) \| ([\d.]+) \| (\d+) \| ([^|]*) \| ([^|]*) \|$", out.stdout, re.M)
    counts = {w: sum(1 for r in rows if r[0] == w) for w in ("tokens", "training", "serving", "churn")}
    assert counts == {"tokens": 2, "training": 2, "serving": 4, "churn": 9}, out.stdout
    for w, draw, ratio, calls, per_step, kinds in rows:
        assert 1.0 <= float(ratio) < 1.5, (w, draw, ratio)
        assert (kinds.strip() == "none") == (calls == "0"), (w, draw, calls, kinds)
        # Churn's steps are counted as the GPU benchmark counts them; the recordings carry
        # no step marks. A draw with no call in its second half has none a step either.
        if w == "churn":
            m = re.fullmatch(r"([\d.]+) \((\d+)\)", per_step.strip())
            assert m, (draw, per_step)
            assert (calls == "0") <= (float(m.group(1)) == 0.0), (draw, calls, per_step)
        else:
            assert per_step.strip() == "-", (w, draw, per_step)
    for w in counts:
        steps = r"; a step off peak: mean [\d.]+, most [\d.]+" if w == "churn" else ""
        assert re.search(rf"^{w}: worst [\d.]+, calls \d+ a draw \(most \d+\) over {counts[w]} draws{steps}$", out.stdout, re.M), out.stdout

    # The recording of churn's draw 0, replayed directly, gives the generated draw's figures.
    recorded = tmp_path / "churn.csv"
    with lzma.open(ROOT / "tests" / "data" / "draws" / "churn.csv.xz") as src:
        recorded.write_bytes(src.read())
    direct = subprocess.run([str(REPLAY), str(recorded), "--pool", "arena"], capture_output=True, text=True, timeout=120)
    assert direct.returncode == 0, direct.stderr
    cells = [c.strip() for c in next(l for l in direct.stdout.splitlines() if l.startswith("| arena |")).strip("|").split("|")]
    churn0 = next(r for r in rows if r[0] == "churn" and r[1] == "0")
    assert (churn0[2], churn0[3]) == (cells[3], cells[10].split("/")[1].strip()), (churn0, cells)
    # And its steps, counted on the recording with the script's own step layout, too.
    sys.path.insert(0, str(ROOT / "bench" / "workloads"))
    import replay_draws
    stepped = subprocess.run([str(REPLAY), str(recorded), "--pool", "arena", "--steps", replay_draws.churn_steps()], capture_output=True, text=True, timeout=120)
    m = re.search(r"^arena steps: 30 measured; second half [\d.]+ driver calls a step, ([\d.]+) off peak \((\d+) new-peak", stepped.stdout, re.M)
    assert m and f"{float(m.group(1)):.2f} ({m.group(2)})" == churn0[4].strip(), (stepped.stdout[-600:], churn0)


def test_a_pool_the_replay_tool_does_not_take_alone_is_refused():
    out = subprocess.run([sys.executable, str(SCRIPT), "--pool", "all"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "invalid choice" in out.stderr, out.stderr
