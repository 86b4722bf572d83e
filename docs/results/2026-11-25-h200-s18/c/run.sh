#!/usr/bin/env bash
# Session 18, run C: is churn's 16-thread slowdown the process heap's? gpupool's churn rows
# on own streams (1, 4, 16 threads) with glibc's malloc, jemalloc and mimalloc preloaded
# (carried in .perf/), twice each, interleaved; then perf profiles of the 1- and 16-thread
# rows with 1,000,000 timed pairs per thread, annotated at the hottest symbols.
set -uo pipefail
O=${OUT:-/tmp/o}; L=$O/logs; mkdir -p $L
P=(./.perf/ld-linux-x86-64.so.2 --library-path $PWD/.perf $PWD/.perf/perf)
{ [ -d build-gpu ] || cmake -S . -B build-gpu -DGPUPOOL_LIBRARY=$PWD/dist/libgpupool.so -DCMAKE_BUILD_TYPE=Release; cmake --build build-gpu -j16 --target threads_bench; } > $L/build.log 2>&1 || { tail -20 $L/build.log; exit 1; }
export THREADS_BENCH_ONLY=gpupool THREADS_BENCH_WORKLOAD=churn THREADS_BENCH_STREAMS=own
for rep in 1 2; do
  for heap in glibc jemalloc mimalloc; do
    case $heap in glibc) PRE=;; jemalloc) PRE=$PWD/.perf/libjemalloc.so.2;; mimalloc) PRE=$PWD/.perf/libmimalloc.so.2;; esac
    LD_PRELOAD=$PRE timeout 60 ./build-gpu/threads_bench 200000 > $L/heap_${heap}_$rep.log 2>&1; echo "== $heap rep $rep rc=$?"
    grep "own stream" $L/heap_${heap}_$rep.log
  done
done
for T in 1 16; do
  THREADS_BENCH_THREADS=$T "${P[@]}" record -F 2999 -o $O/perf_$T.data ./build-gpu/threads_bench 1000000 > $L/tb_perf_$T.log 2>&1; echo "== perf $T rc=$?"
  grep "own stream" $L/tb_perf_$T.log
  "${P[@]}" report -i $O/perf_$T.data --no-children --sort symbol --stdio 2>/dev/null | grep -v "^#" | grep -v "^$" | head -50 > $L/report_$T.txt
  head -32 $L/report_$T.txt | cut -c1-120
  "${P[@]}" report -i $O/perf_$T.data --no-children --sort symbol --stdio -n 2>/dev/null | grep -E "Samples|Event count" | head -3
  for sym in gpupool::registry::route::with_holder gpupool::thread_cache::malloc_kind gpupool::strategy::split::SplitStrategy::free_now gpupool::registry::with_stream_shard gpupool::strategy::split::SplitStrategy::index_remove; do
    "${P[@]}" annotate -i $O/perf_$T.data --stdio -s "$sym" 2>/dev/null | grep -E "^\s+[0-9]+\.[0-9]+ " | sort -rn | head -12 > $L/annotate_${T}_${sym##*::}.txt
  done
  rm -f $O/perf_$T.data
done
echo "== hottest instructions at 16 threads"; for f in $L/annotate_16_*.txt; do echo "-- $f"; head -6 $f | cut -c1-150; done
tar czf $O/logs.tgz -C $O logs && rm -rf $L
