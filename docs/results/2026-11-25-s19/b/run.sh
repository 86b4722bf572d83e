#!/usr/bin/env bash
# Session 19, run B: the GPU check on the new default (arena, sharded by stream), every test
# but the 2-minute split 16x16 stress; then the C thread benchmark with gpupool's split and
# arena rows beside cudaMallocAsync and RMM's resources, and the churn rows on own streams
# five more times (gpupool split and arena only).
set -uo pipefail
cd "$(dirname "$0")/../../../.."
export PYTHONUNBUFFERED=1
SKIP_BENCH=1 CTEST_EXCLUDE=16x16_split scripts/gpu_check.sh $OUT/check > $OUT/check.log 2>&1
sed -n '/SUMMARY/,$p' $OUT/check.log
./build-gpu/threads_bench 50000 > $OUT/tb_all.log 2>&1
cat $OUT/tb_all.log
for i in 1 2 3 4 5; do
  for k in gpupool gpupool-arena; do
    THREADS_BENCH_ONLY=$k THREADS_BENCH_WORKLOAD=churn THREADS_BENCH_STREAMS=own ./build-gpu/threads_bench 200000 2>&1 | grep "^| gpupool"
  done
done > $OUT/tb_churn5.log
cat $OUT/tb_churn5.log
