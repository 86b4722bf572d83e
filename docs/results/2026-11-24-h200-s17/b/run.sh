#!/usr/bin/env bash
# Session 17, run B: every allocator's threads_bench rows (RMM 26.10's C++ resources and
# cudaMallocAsync beside gpupool) with adaptive event batches, then the arena against native
# on the training and serving workloads.
set -uo pipefail
O=${OUT:-/tmp/o}; mkdir -p $O
[ -x build-gpu/threads_bench ] || { echo "no build-gpu (cold machine): building"; SKIP_BENCH=1 CTEST_ONLY=none timeout 200 scripts/gpu_check.sh $O/check > $O/check.log 2>&1; }
timeout 260 ./build-gpu/threads_bench 20000 > $O/tb_all.log 2>&1; echo "tb_all rc=$?"
grep -E "own stream|legacy" $O/tb_all.log
export PYTHONPATH=$PWD/python GPUPOOL_LIBRARY=$PWD/dist/libgpupool.so PYTHONUNBUFFERED=1
timeout 200 python3 scripts/bench_workloads.py all --workloads training,serving --allocators native,arena --out $O/w.jsonl > $O/workloads.log 2>&1; echo "workloads rc=$?"
sed -n '/^### /,$p' $O/workloads.log
