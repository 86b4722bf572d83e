#!/usr/bin/env bash
# Session 19, run H: IPC with the export record (test_ipc device: forged token and freed-block descriptors refused,
# the CuPy IPC test, the host tests) on the final library.
set -uo pipefail
cd "$(dirname "$0")/../../../.."
export PYTHONUNBUFFERED=1 GPUPOOL_LIBRARY=$PWD/dist/libgpupool.so
cmake -S . -B build-gpu -DGPUPOOL_LIBRARY=$PWD/dist/libgpupool.so -DCMAKE_BUILD_TYPE=Release > /tmp/cmake.log 2>&1 \
  && cmake --build build-gpu -j16 --target test_ipc >> /tmp/cmake.log 2>&1 || tail -20 /tmp/cmake.log
./build-gpu/test_ipc device 2>&1 | tee $OUT/test_ipc_device.log | tail -3
python3 -m pytest -q -rs tests/python/test_cupy.py -k "shared_with_another_process" tests/python/test_helper.py 2>&1 | tee $OUT/pytest.log | tail -3
