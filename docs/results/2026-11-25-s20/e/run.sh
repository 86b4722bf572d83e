#!/usr/bin/env bash
# Session 20, run E: process sharing with single-granule imports sharing their granule's
# mapping (library 7b84b9c): the tests, and tensors/s per allocator, two rounds.
set -u
export GPUPOOL_LIBRARY=$PWD/dist/libgpupool.so PYTHONPATH=$PWD/python
nvidia-smi -L
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/python/test_cupy.py -k "shared_with_a_child" 2>&1 | tail -25
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/python/test_torch.py -k "multiprocessing" 2>&1 | tail -25
for round in 1 2; do
  for a in native split arena; do
    timeout 100 python3 scripts/share_check.py --allocator $a --tensors 1000 2>&1 | tail -2
  done
done
