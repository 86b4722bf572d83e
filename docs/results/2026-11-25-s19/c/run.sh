#!/usr/bin/env bash
# Session 19, run C: the workload benchmark on the final library (arena the default, sharded
# by stream), every allocator in one run, in two calls of the device tool (10 minutes each):
#   run.sh 1   tokens + training
#   run.sh 2   serving + churn, then threads_bench's churn rows on own streams 5 times
#              (gpupool split and arena, 200,000 pairs per thread)
set -uo pipefail
cd "$(dirname "$0")/../../../.."
export GPUPOOL_LIBRARY=$PWD/dist/libgpupool.so PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
nvidia-smi -L
if [ "$1" = 1 ]; then W=tokens,training; else W=serving,churn; fi
python3 scripts/bench_workloads.py all --workloads $W --allocators native,expandable,rmm,split,arena \
  --out $OUT/w$1.jsonl 2>&1 | tee $OUT/w$1.log | grep -v "step [0-9]*/\|/[0-9]*: step"
if [ "$1" = 2 ]; then
  cmake -S . -B build-gpu -DGPUPOOL_LIBRARY=$PWD/dist/libgpupool.so -DCMAKE_BUILD_TYPE=Release > /tmp/cmake.log 2>&1 \
    && cmake --build build-gpu -j16 --target threads_bench >> /tmp/cmake.log 2>&1 || tail -20 /tmp/cmake.log
  for i in 1 2 3 4 5; do
    for k in gpupool gpupool-arena; do
      THREADS_BENCH_ONLY=$k THREADS_BENCH_WORKLOAD=churn THREADS_BENCH_STREAMS=own ./build-gpu/threads_bench 200000 2>&1 | grep "^| gpupool"
    done
  done | tee $OUT/tb_churn5.log
fi
