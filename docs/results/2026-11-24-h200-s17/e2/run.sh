#!/usr/bin/env bash
# Session 17, run E: the final library (review fixes: batch reset on any record after a refusal,
# saturating cap, resumable import close): the C tests on the GPU that touch them (IPC on the
# device, every stream_stress row) and test_ipc's own output.
set -uo pipefail
O=${OUT:-/tmp/o}; mkdir -p $O
{ cmake -S . -B build-gpu -DGPUPOOL_LIBRARY=$PWD/dist/libgpupool.so -DCMAKE_BUILD_TYPE=Release && cmake --build build-gpu -j16; } > $O/build.log 2>&1 || { tail -20 $O/build.log; exit 1; }
ctest --test-dir build-gpu --output-on-failure --timeout 300 -R "ipc|stream_stress" -E 16x16 > $O/ctest.log 2>&1; echo "ctest rc=$?"; grep -E "tests passed|Failed|\*\*\*" $O/ctest.log
grep -h "corrupted" build-gpu/Testing/Temporary/LastTest.log | sed 's/.*stream_stress/stream_stress/' | head -20
./build-gpu/test_ipc device > $O/test_ipc_device.log 2>&1; echo "test_ipc rc=$?"; cat $O/test_ipc_device.log
