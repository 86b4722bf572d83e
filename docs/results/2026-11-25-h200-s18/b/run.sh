#!/usr/bin/env bash
# Session 18, run B: where a 16-thread churn row's time goes. The host's CPU topology; a
# profile (perf, carried in .perf/ with its libraries: the host has none) of gpupool's churn
# on its own stream at 1 and at 16 threads; the same workloads over the host upstream
# (examples/threads_host: no driver); three more gpupool runs of every row.
set -uo pipefail
O=${OUT:-/tmp/o}; mkdir -p $O
lscpu > $O/lscpu.txt 2>&1; grep -E "^(Model name|Thread|Core|Socket|NUMA node\(s\)|CPU\(s\))" $O/lscpu.txt
echo "siblings: $(for c in $(seq 0 15); do cat /sys/devices/system/cpu/cpu$c/topology/thread_siblings_list 2>/dev/null; done | paste -sd' ')"
echo "perf_event_paranoid $(cat /proc/sys/kernel/perf_event_paranoid)"
P=(./.perf/ld-linux-x86-64.so.2 --library-path $PWD/.perf $PWD/.perf/perf)
"${P[@]}" stat -e task-clock,context-switches,cpu-migrations,page-faults,cycles,instructions true 2>&1 | tail -12
{ [ -d build-gpu ] || cmake -S . -B build-gpu -DGPUPOOL_LIBRARY=$PWD/dist/libgpupool.so -DCMAKE_BUILD_TYPE=Release; cmake --build build-gpu -j16 --target threads_bench; } > $O/build.log 2>&1 || { tail -20 $O/build.log; exit 1; }
for T in 1 16; do
  export THREADS_BENCH_ONLY=gpupool THREADS_BENCH_WORKLOAD=churn THREADS_BENCH_STREAMS=own THREADS_BENCH_THREADS=$T
  "${P[@]}" stat -e task-clock,context-switches,cpu-migrations,page-faults,cycles,instructions,cache-misses -o $O/stat_$T.txt ./build-gpu/threads_bench 200000 > $O/tb_stat_$T.log 2>&1
  "${P[@]}" record -F 1999 -o $O/perf_$T.data ./build-gpu/threads_bench 200000 > $O/tb_perf_$T.log 2>&1; echo "== perf $T rc=$?"
  grep "own stream" $O/tb_stat_$T.log $O/tb_perf_$T.log; cat $O/stat_$T.txt
  "${P[@]}" report -i $O/perf_$T.data --no-children --sort dso,symbol --stdio 2>/dev/null | grep -v "^#" | grep -v "^$" | head -60 > $O/report_$T.txt
  head -40 $O/report_$T.txt
  rm -f $O/perf_$T.data
done
unset THREADS_BENCH_WORKLOAD THREADS_BENCH_STREAMS THREADS_BENCH_THREADS
timeout 120 ./dist/threads_host 200000 > $O/threads_host.log 2>&1; echo "== threads_host rc=$?"; grep -E "own stream" $O/threads_host.log
for i in 4 5 6; do
  THREADS_BENCH_ONLY=gpupool timeout 60 ./build-gpu/threads_bench 200000 > $O/tb_gpupool_200k_$i.log 2>&1; echo "== gpupool 200k run $i rc=$?"; grep "own stream" $O/tb_gpupool_200k_$i.log
done
