#!/usr/bin/env bash
# Session 17, run A: the GPU check with the IPC review fixes and adaptive event batches
# (ctest with ipc_device, stream_stress, pytest with the CuPy IPC test), test_ipc's own output,
# then threads_bench: gpupool alone three times at 200,000 pairs, 16 threads against 16 processes once.
set -uo pipefail
O=${OUT:-/tmp/o}; mkdir -p $O
echo "ulimit -n: $(ulimit -n) hard $(ulimit -Hn); kernel $(uname -r); nproc $(nproc)"
SKIP_BENCH=1 CTEST_EXCLUDE=16x16 timeout 380 scripts/gpu_check.sh $O/check > $O/check.log 2>&1; echo "check rc=$?"
grep -E "GPU CHECK|tests passed|ipc_|stream_stress" $O/check.log | head -20
./build-gpu/test_ipc device > $O/test_ipc_device.log 2>&1; echo "test_ipc rc=$?"; cat $O/test_ipc_device.log
tail -3 $O/check/pytest.log; grep -iE "ipc|FAIL" $O/check/pytest.log | head
grep -hE "corrupted" $O/check/*.log 2>/dev/null | head -20
for i in 1 2 3; do
  THREADS_BENCH_ONLY=gpupool timeout 60 ./build-gpu/threads_bench 200000 > $O/tb_gpupool_200k_$i.log 2>&1; echo "== gpupool 200k run $i rc=$?"; grep "own stream" $O/tb_gpupool_200k_$i.log
done
THREADS_BENCH_PROCS=16 timeout 100 ./build-gpu/threads_bench 200000 > $O/tb_procs.log 2>&1; echo "== procs rc=$?"; grep -E "^procs" $O/tb_procs.log | sed 's/^procs: gpupool //'
