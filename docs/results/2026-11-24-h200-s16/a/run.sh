#!/usr/bin/env bash
# Session 16, run A: the GPU check (ctest with ipc_device, pytest with the CuPy IPC test),
# the IPC test's own output, then the arena against native on training and serving
# (granules are now created shareable).
set -uo pipefail
O=${OUT:-/tmp/o}; mkdir -p $O
echo "ulimit -n: $(ulimit -n) hard $(ulimit -Hn); ptrace_scope: $(cat /proc/sys/kernel/yama/ptrace_scope 2>&1); kernel $(uname -r)"
SKIP_BENCH=1 CTEST_EXCLUDE=16x16 timeout 380 scripts/gpu_check.sh $O/check > $O/check.log 2>&1; echo "check rc=$?"
grep -E "GPU CHECK|tests passed|ipc_" $O/check.log | head
./build-gpu/test_ipc device > $O/test_ipc_device.log 2>&1; echo "test_ipc rc=$?"; cat $O/test_ipc_device.log
tail -3 $O/check/pytest.log; grep -iE "ipc|FAIL" $O/check/pytest.log | head
export PYTHONPATH=$PWD/python GPUPOOL_LIBRARY=$PWD/dist/libgpupool.so PYTHONUNBUFFERED=1
timeout 190 python3 scripts/bench_workloads.py all --workloads training,serving --allocators native,arena --out $O/w.jsonl > $O/workloads.log 2>&1; echo "workloads rc=$?"
sed -n '/^### /,$p' $O/workloads.log
