#!/usr/bin/env bash
# Session 20, run A: the process-sharing route on the GPU (first proof).
set -u
export GPUPOOL_LIBRARY=$PWD/dist/libgpupool.so PYTHONPATH=$PWD/python
nvidia-smi -L
python3 -m pytest -q -p no:cacheprovider tests/python/test_share.py tests/python/test_torch.py -k "share or multiprocessing" 2>&1 | tail -30
python3 -m pytest -q -p no:cacheprovider tests/python/test_cupy.py -k "shared_with_a_child" 2>&1 | tail -30
for a in native split arena; do
  timeout 200 python3 scripts/share_check.py --allocator $a --tensors 1000 2>&1 | tail -5
done
