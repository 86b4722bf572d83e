#!/usr/bin/env bash
# Session 17, run D: where the 16-thread rows' driver calls go (THREADS_BENCH_CALLS=1: calls by
# kind and cross-stream reuses per row), gpupool alone at 200,000 pairs, three times.
set -uo pipefail
O=${OUT:-/tmp/o}; mkdir -p $O
{ cmake -S . -B build-gpu -DGPUPOOL_LIBRARY=$PWD/dist/libgpupool.so -DCMAKE_BUILD_TYPE=Release && cmake --build build-gpu -j16 --target threads_bench; } > $O/build.log 2>&1 || { tail -20 $O/build.log; exit 1; }
for i in 1 2 3; do
  THREADS_BENCH_CALLS=1 THREADS_BENCH_ONLY=gpupool timeout 60 ./build-gpu/threads_bench 200000 > $O/tb_calls_$i.log 2>&1; echo "== run $i rc=$?"; grep -E "own stream" $O/tb_calls_$i.log | grep -E "churn|serving"
done
