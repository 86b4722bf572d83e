#!/usr/bin/env bash
# Session 22, run C (one H100): the workload script as split this session, in its quick mode
# (a smoke run: every workload tiny), native / split / arena; the device call's own limit
# was 150 s, which stopped the last process (churn on the arena).
cd "$(dirname "$0")/../../../.."
export PYTHONPATH=$PWD/python GPUPOOL_LIBRARY=$PWD/dist/libgpupool.so
BENCH_QUICK=1 timeout 150 python3 scripts/bench_workloads.py all --allocators native,split,arena --out $OUT/quick.jsonl 2>&1 \
  | tee $OUT/quick.log | grep -v "step [0-9]*/\|/[0-9]*: step" | tail -30
