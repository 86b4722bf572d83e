#!/usr/bin/env bash
# Session 23, run C. Parts:
#   tb16ab   threads_bench churn on own streams, 1 and 16 threads, split and arena, the
#            library at the session's start (dist/libgpupool-base.so, 89000d4) and with the
#            arena's growths recording pending frees only where they call the driver
#            (dist/libgpupool-new.so, 6f210a3), alternating, four rounds (200,000 pairs a
#            thread); driver calls of one arena row of each library
#   serving3 scripts/bench_workloads.py all --workloads serving --allocators native,split,arena
#            --rounds 3 (the new library): serving's tokens/s moves by tens of per cent
#            between processes, so one process per allocator says little
set -uo pipefail
cd "$(dirname "$0")/../../../.."
export GPUPOOL_LIBRARY=$PWD/dist/libgpupool.so PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD/python:/tmp/site
nvidia-smi -L
build() {
  [ -x build-gpu/threads_bench ] && return
  cmake -S . -B build-gpu -DGPUPOOL_LIBRARY=$PWD/dist/libgpupool.so -DCMAKE_BUILD_TYPE=Release > /tmp/cmake.log 2>&1 \
    && cmake --build build-gpu -j16 >> /tmp/cmake.log 2>&1 || tail -20 /tmp/cmake.log
}
for part in "$@"; do
  echo "== $part $(date +%T)"
  case "$part" in
    tb16ab)
      build
      for i in 1 2 3 4; do
        for v in base new; do
          cp dist/libgpupool-$v.so dist/libgpupool.so
          for k in gpupool gpupool-arena; do
            for t in 1 16; do
              THREADS_BENCH_ONLY=$k THREADS_BENCH_WORKLOAD=churn THREADS_BENCH_STREAMS=own THREADS_BENCH_THREADS=$t ./build-gpu/threads_bench 200000 2>&1 | grep "^| gpupool" | sed "s/^/$v $i /"
            done
          done
        done
      done | tee $OUT/tb16ab.log
      for v in base new; do
        cp dist/libgpupool-$v.so dist/libgpupool.so
        THREADS_BENCH_CALLS=1 THREADS_BENCH_ONLY=gpupool-arena THREADS_BENCH_WORKLOAD=churn THREADS_BENCH_STREAMS=own THREADS_BENCH_THREADS=16 ./build-gpu/threads_bench 200000 2>&1 | tail -4 | sed "s/^/$v calls /"
      done | tee $OUT/tb16calls.log
      cp dist/libgpupool-new.so dist/libgpupool.so ;;
    serving3)
      cp dist/libgpupool-new.so dist/libgpupool.so
      python3 scripts/bench_workloads.py all --workloads serving --allocators native,split,arena --rounds 3 \
        --out $OUT/serving3.jsonl 2>&1 | tee $OUT/serving3.log | grep -v "step [0-9]*/\|/[0-9]*: step" | tail -14 ;;
  esac
done
