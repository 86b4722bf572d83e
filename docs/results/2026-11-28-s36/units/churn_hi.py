"""Churn draws with larger blocks than the benchmark's (512 B to HI instead of 32 MiB),
replayed under several chunk thresholds: whether a threshold just above the benchmark's
largest block is chance fitted to it (session 36). Prints, per HI and threshold, the mean
and worst peak reserved / peak in use over the draws and the mean driver calls a step off
peak.

    python3 churn_hi.py DRAWS HI_MiB[,HI_MiB...] THRESHOLD[,THRESHOLD...]
"""
import os, sys, tempfile
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "scripts"))
import replay_draws as rd

draws, his, ths = int(sys.argv[1]), [int(h) for h in sys.argv[2].split(",")], sys.argv[3].split(",")
tool = os.path.join(rd.ROOT, "target", "release", "gpupool-replay")
with tempfile.TemporaryDirectory() as tmp:
    for hi in his:
        paths = []
        for d in range(draws):
            p = os.path.join(tmp, f"churn-{hi}-{d}.csv")
            rd.churn_trace(d, p, hi=hi << 20)
            paths.append(p)
        for th in ths:
            rd.EXTRA[:] = ["--arena-chunk-from", th]
            got = [rd.replay(tool, "arena", p, rd.churn_steps()) for p in paths]
            ratios = [g[0] for g in got]
            steps = [float(g[3].split()[0]) for g in got]
            print(f"hi {hi} MiB, chunks from {th}: mean {sum(ratios) / len(ratios):.4f} worst {max(ratios):.3f}, "
                  f"calls a step off peak {sum(steps) / len(steps):.2f}, draws <= 1.05: {sum(r <= 1.05 for r in ratios)}", flush=True)
