#!/usr/bin/env bash
# Session 22, run A: the library as session 21 left it (and this session's changes, run by
# run by run; each run's README line names the commit), in calls of the device tool
# (10 minutes each). Parts, any number in one call:
#   ctest    every C test, example and GPU test but the 16x16 split stress
#   share    scripts/share_check.py --tensors 1000 for native, split, arena (tensors/s, checks)
#   bench    tokens + training workloads, every allocator in one run (one process each)
#   bench2   serving + churn workloads
#   tb       threads_bench churn rows on own streams, five times, gpupool split and arena
#   pytest1 / pytest2   the Python tests in two halves (PYTEST part 1: torch, part 2: the rest)
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
    bench|bench2)
      if [ "$part" = bench ]; then W=tokens,training; else W=serving,churn; fi
      python3 scripts/bench_workloads.py all --workloads $W --allocators native,expandable,rmm,split,arena \
        --out $OUT/$part.jsonl 2>&1 | tee $OUT/$part.log | grep -v "step [0-9]*/\|/[0-9]*: step" | tail -40 ;;
    ctest)
      build
      ctest --test-dir build-gpu --output-on-failure --timeout 300 -E 16x16_split 2>&1 | tee $OUT/ctest.log | tail -8 ;;
    share)
      for a in native split arena; do
        timeout 150 python3 scripts/share_check.py --allocator $a --tensors 1000 2>&1 | tee -a $OUT/share.log | tail -4
      done ;;
    tb)
      build
      for i in 1 2 3 4 5; do
        for k in gpupool gpupool-arena; do
          THREADS_BENCH_ONLY=$k THREADS_BENCH_WORKLOAD=churn THREADS_BENCH_STREAMS=own ./build-gpu/threads_bench 200000 2>&1 | grep "^| gpupool"
        done
      done | tee $OUT/tb_churn5.log ;;
    pytest1|pytest2)
      if [ "$part" = pytest1 ]; then F=$(ls tests/python/test_*torch*.py); else F=$(ls tests/python/test_*.py | grep -v torch); fi
      python3 -m pytest -v -rs $F 2>&1 | tee $OUT/$part.log | grep -E "FAILED|ERROR|SKIPPED|passed|failed" | tail -40 ;;
  esac
done
