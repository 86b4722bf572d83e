#!/usr/bin/env bash
# Session 15, run C: is the in-process loss at 16 threads the driver's event calls? procs mode with default and with big event batches.
set -uo pipefail
O=${OUT:-/tmp/o}; mkdir -p $O
cmake -S . -B build-gpu -DGPUPOOL_LIBRARY=$PWD/dist/libgpupool.so -DCMAKE_BUILD_TYPE=Release > $O/build.log 2>&1 && cmake --build build-gpu -j16 --target threads_bench >> $O/build.log 2>&1 || { tail -20 $O/build.log; exit 1; }
for i in 1 2; do
  THREADS_BENCH_PROCS=16 ./build-gpu/threads_bench 200000 > $O/procs_default_$i.log 2>&1; echo "== default $i rc=$?"; grep -E "^procs" $O/procs_default_$i.log | sed 's/^procs: //'
  GPUPOOL_EVENT_BATCH=4096 GPUPOOL_EVENT_BATCH_BYTES=4GiB THREADS_BENCH_PROCS=16 ./build-gpu/threads_bench 200000 > $O/procs_batch_$i.log 2>&1; echo "== big event batch $i rc=$?"; grep -E "^procs|own stream \| 16" $O/procs_batch_$i.log | sed 's/^procs: //'
done
