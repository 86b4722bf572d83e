#!/usr/bin/env bash
# Session 20, run F: the final library (33dc725): the GPU check (every ctest but the 16x16
# split stress, every Python test), then tensors/s through torch.multiprocessing once more.
set -u
SKIP_BENCH=1 CTEST_EXCLUDE=16x16_split timeout 470 scripts/gpu_check.sh "$OUT/check" > "$OUT/check.log" 2>&1
echo "gpu_check rc=$?" >> "$OUT/check.log"
export GPUPOOL_LIBRARY=$PWD/dist/libgpupool.so PYTHONPATH=$PWD/python
for a in native split arena; do
  timeout 40 python3 scripts/share_check.py --allocator $a --tensors 1000 2>&1 | tail -1
done > "$OUT/share.log"
