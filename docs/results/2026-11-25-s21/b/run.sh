#!/usr/bin/env bash
# Session 21, run B (2 x H100, library 90fb657: the arena maps long growths as chunks), in
# calls of the device tool (10 minutes each):
#   run.sh bench   tokens + training workloads, every allocator in one run (one process each)
#   run.sh ctest   every C test, example and GPU test but the 16x16 split stress
#   run.sh pytest  every Python test (PyTorch, CuPy, Numba; two-GPU peer copies and DDP)
#   run.sh bench2  serving + churn workloads
set -uo pipefail
cd "$(dirname "$0")/../../../.."
export GPUPOOL_LIBRARY=$PWD/dist/libgpupool.so PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
nvidia-smi -L
case "$1" in
  bench|bench2)
    if [ "$1" = bench ]; then W=tokens,training; N=w1; else W=serving,churn; N=w2; fi
    python3 scripts/bench_workloads.py all --workloads $W --allocators native,expandable,rmm,split,arena \
      --out $OUT/$N.jsonl 2>&1 | tee $OUT/$N.log | grep -v "step [0-9]*/\|/[0-9]*: step" | tail -40 ;;
  ctest)
    cmake -S . -B build-gpu -DGPUPOOL_LIBRARY=$PWD/dist/libgpupool.so -DCMAKE_BUILD_TYPE=Release > /tmp/cmake.log 2>&1 \
      && cmake --build build-gpu -j16 >> /tmp/cmake.log 2>&1 || tail -20 /tmp/cmake.log
    ctest --test-dir build-gpu --output-on-failure --timeout 300 -E 16x16_split 2>&1 | tee $OUT/ctest.log | tail -15 ;;
  pytest)
    python3 -m pytest -v -rs tests/python 2>&1 | tee $OUT/pytest.log | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" | tail -80 ;;
esac
