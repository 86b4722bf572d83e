#!/usr/bin/env bash
# Session 23, run D: where process sharing's time goes. scripts/share_check.py --tensors
# 1000 --profile (cProfile of the producer's pickling and of the consumer), native then
# arena, on the library dist/libgpupool-new.so (6f210a3); then run A's `tb16` part (churn
# on own streams, 1 and 16 threads, split and arena, four rounds) on the same library.
set -uo pipefail
cd "$(dirname "$0")/../../../.."
cp dist/libgpupool-new.so dist/libgpupool.so
export GPUPOOL_LIBRARY=$PWD/dist/libgpupool.so PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD/python:/tmp/site
nvidia-smi -L
for a in native arena native arena; do
  timeout 150 python3 scripts/share_check.py --allocator $a --tensors 1000 --profile $OUT 2>&1 | tail -1 | cut -c1-400
done | tee $OUT/share.log
for f in $OUT/*-*.txt; do echo "== $f"; sed -n 1,40p $f | cut -c1-160; done | head -200
docs/results/2026-11-25-s23/a/run.sh tb16
