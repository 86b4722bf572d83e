#!/usr/bin/env bash
# Session 15, run A: the GPU host's CPU topology, then threads_bench pinned three times.
set -uo pipefail
O=${OUT:-/tmp/o}; mkdir -p $O
{ lscpu; echo; for c in /sys/devices/system/cpu/cpu[0-9]*; do echo "$(basename $c) siblings=$(cat $c/topology/thread_siblings_list 2>/dev/null) core=$(cat $c/topology/core_id 2>/dev/null) pkg=$(cat $c/topology/physical_package_id 2>/dev/null)"; done; } > $O/topology.txt 2>&1
grep -E "^(Model name|Thread|Core|Socket|CPU\(s\)|L1d|L2|L3|NUMA)" $O/topology.txt; grep siblings $O/topology.txt | head -16
rm -rf /tmp/rmm && mkdir -p /tmp/rmm && for w in .whl/librmm*.whl .whl/rapids_logger*.whl; do python3 -m zipfile -e "$w" /tmp/rmm; done
cmake -S . -B build-gpu -DGPUPOOL_LIBRARY=$PWD/dist/libgpupool.so -DCMAKE_BUILD_TYPE=Release -DGPUPOOL_RMM_ROOT=/tmp/rmm/librmm -DGPUPOOL_RAPIDS_LOGGER_ROOT=/tmp/rmm/rapids_logger > $O/build.log 2>&1 && cmake --build build-gpu -j16 --target threads_bench >> $O/build.log 2>&1 || { tail -20 $O/build.log; exit 1; }
for i in 1 2 3; do
  THREADS_BENCH_ONLY=gpupool ./build-gpu/threads_bench 200000 > $O/tb_gpupool_200k_$i.log 2>&1
  echo "== gpupool 200k run $i"; grep "own stream" $O/tb_gpupool_200k_$i.log
done
./build-gpu/threads_bench 20000 > $O/tb_all.log 2>&1; echo tb_all rc=$?
grep -E "own stream|legacy" $O/tb_all.log | head -80
