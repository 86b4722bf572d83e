#!/usr/bin/env bash
# Session 19, run I (on run H's warm machine, build-gpu from run H): every ctest but the
# 16x16 stresses, and the CuPy, graphs, helper and PyTorch Python tests, on the final library.
export PYTHONUNBUFFERED=1 GPUPOOL_LIBRARY=$PWD/dist/libgpupool.so
cmake --build build-gpu -j16 > /tmp/b.log 2>&1 || tail -5 /tmp/b.log
(ctest --test-dir build-gpu -E "16x16" --timeout 120 2>&1 | tail -4
 python3 -m pytest -q -rs tests/python/test_cupy.py tests/python/test_graphs.py tests/python/test_helper.py tests/python/test_torch.py 2>&1 | tail -6) | tee $OUT/final.log
