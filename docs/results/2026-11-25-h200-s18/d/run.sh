#!/usr/bin/env bash
# Session 18, run D: the controls for the 16-thread rows. Every allocator's table (RMM 26.10's
# C++ pool, arena and cuda_async, cudaMallocAsync) on this library; 16 one-thread processes
# against one process of 16 threads (THREADS_BENCH_PROCS=16); and churn and serving with one
# thread pinned to each CPU in turn, then 16 threads (THREADS_BENCH_PER_CPU=1).
set -uo pipefail
O=${OUT:-/tmp/o}; L=$O/logs; mkdir -p $L
rm -rf /tmp/gpupool-rmm && mkdir -p /tmp/gpupool-rmm
for w in .whl/librmm*.whl .whl/rapids_logger*.whl; do python3 -m zipfile -e "$w" /tmp/gpupool-rmm; done
{ cmake -S . -B build-gpu -DGPUPOOL_LIBRARY=$PWD/dist/libgpupool.so -DCMAKE_BUILD_TYPE=Release \
    -DGPUPOOL_RMM_ROOT=/tmp/gpupool-rmm/librmm -DGPUPOOL_RAPIDS_LOGGER_ROOT=/tmp/gpupool-rmm/rapids_logger \
  && cmake --build build-gpu -j16 --target threads_bench; } > $L/build.log 2>&1 || { tail -20 $L/build.log; exit 1; }
timeout 270 ./build-gpu/threads_bench 20000 > $L/tb_all.log 2>&1; echo "== tb_all rc=$?"
grep -E "own stream|legacy" $L/tb_all.log
THREADS_BENCH_PROCS=16 timeout 120 ./build-gpu/threads_bench 200000 > $L/tb_procs.log 2>&1; echo "== procs rc=$?"
grep -E "^procs" $L/tb_procs.log | sed 's/^procs: gpupool //'
for wl in churn serving; do
  THREADS_BENCH_PER_CPU=1 THREADS_BENCH_ONLY=gpupool THREADS_BENCH_WORKLOAD=$wl timeout 90 ./build-gpu/threads_bench 200000 > $L/tb_per_cpu_$wl.log 2>&1; echo "== per cpu $wl rc=$?"
  grep -E "own stream" $L/tb_per_cpu_$wl.log | grep -v "^cpu " | head -3; grep -E "^summary" $L/tb_per_cpu_$wl.log
done
tar czf $O/logs.tgz -C $O logs && rm -rf $L
