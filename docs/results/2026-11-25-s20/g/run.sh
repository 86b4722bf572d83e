#!/usr/bin/env bash
# Session 20, run G: the final library after the file splits and renames (a600660): every
# ctest but the 16x16 stresses, and the PyTorch and CuPy tests (sharing included).
set -u
export PYTHONUNBUFFERED=1 GPUPOOL_LIBRARY=$PWD/dist/libgpupool.so PYTHONPATH=$PWD/python
nvidia-smi -L
cmake -S . -B build-gpu -DGPUPOOL_LIBRARY="$GPUPOOL_LIBRARY" -DCMAKE_BUILD_TYPE=Release > /tmp/cmake.log 2>&1 && cmake --build build-gpu -j16 >> /tmp/cmake.log 2>&1 || tail -20 /tmp/cmake.log
timeout 200 ctest --test-dir build-gpu -E "16x16" --timeout 120 2>&1 | tail -6
timeout 200 python3 -m pytest -q -rs tests/python/test_torch.py tests/python/test_cupy.py 2>&1 | tail -8
