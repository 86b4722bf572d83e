#!/usr/bin/env bash
# Session 16, run B: what churn's 16 threads wait on: context switches per row, 16 threads
# against 16 one-thread processes (twice), and gpupool alone at 200,000 pairs.
set -uo pipefail
O=${OUT:-/tmp/o}; mkdir -p $O
cmake -S . -B build-gpu -DGPUPOOL_LIBRARY=$PWD/dist/libgpupool.so -DCMAKE_BUILD_TYPE=Release > $O/build.log 2>&1 && cmake --build build-gpu -j16 --target threads_bench >> $O/build.log 2>&1 || { tail -20 $O/build.log; exit 1; }
for i in 1 2; do
  THREADS_BENCH_PROCS=16 ./build-gpu/threads_bench 200000 > $O/tb_procs_$i.log 2>&1; echo "== procs run $i rc=$?"; grep -E "^procs|own stream \| 16" $O/tb_procs_$i.log
done
THREADS_BENCH_ONLY=gpupool ./build-gpu/threads_bench 200000 > $O/tb_gpupool_200k.log 2>&1; echo "== gpupool 200k"; grep "own stream" $O/tb_gpupool_200k.log
GPUPOOL_EVENT_BATCH=4096 GPUPOOL_EVENT_BATCH_BYTES=4GiB THREADS_BENCH_PROCS=16 ./build-gpu/threads_bench 200000 > $O/tb_procs_bigbatch.log 2>&1; echo "== big event batch"; grep -E "^procs|own stream \| 16" $O/tb_procs_bigbatch.log
