#!/usr/bin/env bash
# Session 20, run B: the process-sharing route on the GPU after run A's fixes (the test's
# consumer changed bases before checking their views; failing parents hung on a live child).
set -u
export GPUPOOL_LIBRARY=$PWD/dist/libgpupool.so PYTHONPATH=$PWD/python
nvidia-smi -L
timeout 280 python3 -m pytest -q -p no:cacheprovider tests/python/test_cupy.py -k "shared_with_a_child" 2>&1 | tail -40
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/python/test_torch.py -k "multiprocessing" 2>&1 | tail -30
for a in native split arena; do
  timeout 100 python3 scripts/share_check.py --allocator $a --tensors 1000 2>&1 | tail -3
done
