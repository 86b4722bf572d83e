#!/usr/bin/env bash
# Session 23, run B: where the time goes, with perf (Debian's linux-perf 6.1, carried in
# dist/perf/ with the libraries it needs), on the library at 89000d4 with its symbols
# (dist/libgpupool-sym.so: debug info stripped, symbol table kept). Parts:
#   tperf   threads_bench churn, own streams, 16 threads: perf stat and a flat perf profile,
#           split then arena (issue #33: the arena runs 12-16 % behind split there)
#   sperf   scripts/share_check.py --tensors 1000 under perf record (producer and consumer),
#           native then arena (issue #35: the arena's tensors/s below native)
set -uo pipefail
cd "$(dirname "$0")/../../../.."
cp dist/libgpupool-sym.so dist/libgpupool.so
export GPUPOOL_LIBRARY=$PWD/dist/libgpupool.so PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD/python:/tmp/site
nvidia-smi -L
PL=$PWD/dist/perf/lib
pf() { LD_LIBRARY_PATH=$PL $PWD/dist/perf/perf "$@"; }
pf --version; cat /proc/sys/kernel/perf_event_paranoid; nproc; lscpu | grep -E "Model name|L3|Socket|NUMA node\(s\)"
build() {
  [ -x build-gpu/threads_bench ] && return
  cmake -S . -B build-gpu -DGPUPOOL_LIBRARY=$PWD/dist/libgpupool.so -DCMAKE_BUILD_TYPE=Release > /tmp/cmake.log 2>&1 \
    && cmake --build build-gpu -j16 >> /tmp/cmake.log 2>&1 || tail -20 /tmp/cmake.log
}
report() { pf report -i "$1" --no-children --sort dso,sym --stdio 2>/dev/null | grep -v "^#" | grep -v "^$" | head -${2:-70}; }
for part in "$@"; do
  echo "== $part $(date +%T)"
  case "$part" in
    tperf)
      build
      for k in gpupool gpupool-arena gpupool gpupool-arena; do
        pf stat -e task-clock,cycles,instructions,cache-misses,L1-dcache-load-misses,LLC-load-misses,context-switches,cpu-migrations -o $OUT/stat-$k.txt --append -- \
          env THREADS_BENCH_ONLY=$k THREADS_BENCH_WORKLOAD=churn THREADS_BENCH_STREAMS=own THREADS_BENCH_THREADS=16 ./build-gpu/threads_bench 200000 2>&1 | grep "^| gpupool"
      done
      for k in gpupool gpupool-arena; do
        pf record -F 1999 -o /tmp/perf.$k -- env THREADS_BENCH_ONLY=$k THREADS_BENCH_WORKLOAD=churn THREADS_BENCH_STREAMS=own THREADS_BENCH_THREADS=16 ./build-gpu/threads_bench 200000 2>&1 | grep "^| gpupool"
        report /tmp/perf.$k > $OUT/perf-$k.txt; head -40 $OUT/perf-$k.txt
      done
      cat $OUT/stat-*.txt | grep -v "^$" ;;
    sperf)
      for a in native arena; do
        pf record -F 999 -o /tmp/sperf.$a -- timeout 150 python3 scripts/share_check.py --allocator $a --tensors 1000 2>&1 | tail -1 | cut -c1-200
        report /tmp/sperf.$a 90 > $OUT/sperf-$a.txt; head -45 $OUT/sperf-$a.txt
      done ;;
  esac
done
