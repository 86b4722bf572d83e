#!/usr/bin/env bash
# Session 16, run C: the new event-batch defaults (256 frees / 256 MiB): 16 threads against
# 16 processes twice, gpupool alone twice at 200,000 pairs, every allocator (RMM's too) once.
set -uo pipefail
O=${OUT:-/tmp/o}; mkdir -p $O
rm -rf /tmp/rmm && mkdir -p /tmp/rmm && for w in .whl/librmm*.whl .whl/rapids_logger*.whl; do python3 -m zipfile -e "$w" /tmp/rmm; done
cmake -S . -B build-gpu -DGPUPOOL_LIBRARY=$PWD/dist/libgpupool.so -DCMAKE_BUILD_TYPE=Release -DGPUPOOL_RMM_ROOT=/tmp/rmm/librmm -DGPUPOOL_RAPIDS_LOGGER_ROOT=/tmp/rmm/rapids_logger > $O/build.log 2>&1 && cmake --build build-gpu -j16 --target threads_bench >> $O/build.log 2>&1 || { tail -20 $O/build.log; exit 1; }
for i in 1 2; do
  THREADS_BENCH_PROCS=16 ./build-gpu/threads_bench 200000 > $O/tb_procs_$i.log 2>&1; echo "== procs run $i rc=$?"; grep -E "^procs" $O/tb_procs_$i.log | sed 's/^procs: gpupool //'
done
for i in 1 2; do
  THREADS_BENCH_ONLY=gpupool ./build-gpu/threads_bench 200000 > $O/tb_gpupool_200k_$i.log 2>&1; echo "== gpupool 200k run $i"; grep "own stream" $O/tb_gpupool_200k_$i.log
done
timeout 250 ./build-gpu/threads_bench 20000 > $O/tb_all.log 2>&1; echo "tb_all rc=$?"
grep -E "own stream|legacy" $O/tb_all.log
