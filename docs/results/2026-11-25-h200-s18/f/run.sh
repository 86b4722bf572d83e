#!/usr/bin/env bash
# Session 18, run F: the threads-against-processes control again, twice, on the final library
# (THREADS_BENCH_PROCS=16: 16 one-thread processes at once against one process of 16 threads).
set -uo pipefail
O=${OUT:-/tmp/o}; mkdir -p $O
{ cmake -S . -B build-gpu -DGPUPOOL_LIBRARY=$PWD/dist/libgpupool.so -DCMAKE_BUILD_TYPE=Release && cmake --build build-gpu -j16 --target threads_bench; } > $O/build.log 2>&1 || { tail -20 $O/build.log; exit 1; }
for i in 1 2; do
  THREADS_BENCH_PROCS=16 timeout 150 ./build-gpu/threads_bench 200000 > $O/tb_procs_$i.log 2>&1; echo "== procs run $i rc=$?"
  grep -E "^procs" $O/tb_procs_$i.log | sed 's/^procs: gpupool //'
done
