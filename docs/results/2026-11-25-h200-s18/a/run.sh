#!/usr/bin/env bash
# Session 18, run A: streams move off a shard another live stream allocates on (the shard's
# last allocating stream, not only its lock, is the sign). The GPU check (stream_stress
# among it), then threads_bench gpupool alone with THREADS_BENCH_CALLS=1, three times at
# 200,000 pairs: every 16-thread row's driver calls and cross-stream reuses.
set -uo pipefail
O=${OUT:-/tmp/o}; mkdir -p $O
echo "nproc $(nproc); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
SKIP_BENCH=1 CTEST_EXCLUDE=16x16 timeout 330 scripts/gpu_check.sh $O/check > $O/check.log 2>&1; echo "check rc=$?"
grep -E "GPU CHECK|tests passed|stream_stress" $O/check.log | head -20
tail -3 $O/check/pytest.log
grep -hE "corrupted" $O/check/*.log 2>/dev/null | head -20
for i in 1 2 3; do
  THREADS_BENCH_CALLS=1 THREADS_BENCH_ONLY=gpupool timeout 60 ./build-gpu/threads_bench 200000 > $O/tb_calls_$i.log 2>&1; echo "== run $i rc=$?"
  grep -E "own stream" $O/tb_calls_$i.log | grep -E "churn|serving|pairs"
done
