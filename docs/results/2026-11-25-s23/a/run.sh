#!/usr/bin/env bash
# Session 23, run A: the library at the session start (89000d4) (dist/libgpupool.so; the commit is in the
# README), in calls of the device tool (10 minutes each). Parts, any number in one call:
#   pytest1 / pytest2  the Python tests in two halves (test_torch.py; the rest)
#   ctest              every C test, example and GPU test but the 16x16 split stress
#   ab                 threads_bench (gpupool split and arena, every workload, own and legacy
#                      streams, 1/4/16 threads, 50,000 pairs a thread) against the library before
#                      issue #36's refactor (dist/libgpupool-before.so, 7713060) and after
#                      (dist/libgpupool-after.so), one round: issue #36's "speed
#                      within noise on the C benchmarks in one run before/after"
#   ab1                the one-thread 1 MiB pair rows of `ab` again, before/after alternating,
#                      three rounds (the p50 moved between the two libraries in `ab`)
#   share              scripts/share_check.py --tensors 1000, native, split, arena
#   tb16               churn on own streams at 1 and 16 threads, split and arena alternating,
#                      four rounds (200,000 pairs a thread)
#   bench / bench2     the workload benchmark (tokens + training / serving + churn)
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
    pytest1|pytest2)
      if [ "$part" = pytest1 ]; then F=tests/python/test_torch.py; else F=$(ls tests/python/test_*.py | grep -v test_torch.py); fi
      python3 -m pytest -v -rs $F 2>&1 | tee $OUT/$part.log | grep -E "FAILED|ERROR|SKIPPED|passed|failed" | tail -40 ;;
    ctest)
      build
      ctest --test-dir build-gpu --output-on-failure --timeout 300 -E 16x16_split 2>&1 | tee $OUT/ctest.log | tail -8 ;;
    ab)
      build
      for round in 1; do
        for v in before after; do
          cp dist/libgpupool-$v.so dist/libgpupool.so
          for k in gpupool gpupool-arena; do
            THREADS_BENCH_ONLY=$k ./build-gpu/threads_bench 50000 2>&1 | grep "^| gpupool" | sed "s/^/$v $round /"
          done
        done
      done | tee $OUT/ab.log
      cp dist/libgpupool-after.so dist/libgpupool.so ;;
    ab1)
      build
      for round in 1 2 3; do
        for v in before after; do
          cp dist/libgpupool-$v.so dist/libgpupool.so
          for k in gpupool gpupool-arena; do
            THREADS_BENCH_ONLY=$k THREADS_BENCH_WORKLOAD=pairs THREADS_BENCH_THREADS=1 ./build-gpu/threads_bench 200000 2>&1 | grep "^| gpupool" | sed "s/^/$v $round /"
          done
        done
      done | tee $OUT/ab1.log
      cp dist/libgpupool-after.so dist/libgpupool.so ;;
    share)
      for round in 1; do
        for a in native split arena; do
          timeout 150 python3 scripts/share_check.py --allocator $a --tensors 1000 2>&1 | tail -1
        done
      done | tee $OUT/share.log ;;
    tb16)
      build
      for i in 1 2 3 4; do
        for k in gpupool gpupool-arena; do
          for t in 1 16; do
            THREADS_BENCH_ONLY=$k THREADS_BENCH_WORKLOAD=churn THREADS_BENCH_STREAMS=own THREADS_BENCH_THREADS=$t ./build-gpu/threads_bench 200000 2>&1 | grep "^| gpupool"
          done
        done
      done | tee $OUT/tb16.log ;;
    bench|bench2)
      if [ "$part" = bench ]; then W=tokens,training; else W=serving,churn; fi
      python3 scripts/bench_workloads.py all --workloads $W --allocators native,expandable,rmm,split,arena \
        --out $OUT/$part.jsonl 2>&1 | tee $OUT/$part.log | grep -v "step [0-9]*/\|/[0-9]*: step" | tail -40 ;;
  esac
done
