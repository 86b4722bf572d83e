#!/usr/bin/env bash
# Session 19, run F: IPC with bound descriptors on the GPU (test_ipc device: CUDA-exported
# granules' file identity checked on import, forged and reused-pid descriptors refused) and
# the CuPy IPC test; the inodes of CUDA-exported descriptors, to see whether they differ.
set -uo pipefail
cd "$(dirname "$0")/../../../.."
export PYTHONUNBUFFERED=1 GPUPOOL_LIBRARY=$PWD/dist/libgpupool.so
cmake -S . -B build-gpu -DGPUPOOL_LIBRARY=$PWD/dist/libgpupool.so -DCMAKE_BUILD_TYPE=Release > /tmp/cmake.log 2>&1 \
  && cmake --build build-gpu -j16 --target test_ipc >> /tmp/cmake.log 2>&1 || tail -20 /tmp/cmake.log
./build-gpu/test_ipc device 2>&1 | tee $OUT/test_ipc_device.log | tail -4
python3 - <<'PY' 2>&1 | tee $OUT/inodes.log
import ctypes, os, gpupool
gpupool.configure(0, pool="arena", upstream="device")
L = gpupool.lib()
p = ctypes.c_void_p()
assert L.gpupool_malloc(ctypes.byref(p), 6 << 20, 0, None) == 0
desc = gpupool.ipc_export(p.value)
fds = gpupool.ipc_descriptor_fds(desc)
print("CUDA-exported granule files (dev, ino):", [(os.fstat(f).st_dev, os.fstat(f).st_ino) for f in fds])
PY
python3 -m pytest -q -rs tests/python/test_cupy.py -k "shared_with_another_process" 2>&1 | tail -3
