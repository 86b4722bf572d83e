#!/usr/bin/env bash
# Session 20, run D: the process-sharing tests (torch, CuPy) and tensors/s through a
# torch.multiprocessing queue per allocator (scripts/share_check.py, 1000 tensors,
# 256 B-64 MiB, one process tree per allocator), library c5cdce0.
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
