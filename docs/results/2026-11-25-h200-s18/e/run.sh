#!/usr/bin/env bash
# Session 18, run E: the library after the review (moves counted per shard, not per stream;
# lock collisions no longer count; a mover claims its shard by advancing its count). The GPU
# check, then threads_bench gpupool alone with THREADS_BENCH_CALLS=1, three times.
set -uo pipefail
O=${OUT:-/tmp/o}; L=$O/logs; mkdir -p $L
SKIP_BENCH=1 CTEST_EXCLUDE=16x16 timeout 330 scripts/gpu_check.sh $L/check > $L/check.log 2>&1; echo "check rc=$?"
grep -E "GPU CHECK|tests passed|tests failed" $L/check.log | head -5
tail -1 $L/check/pytest.log
grep -hE "corrupted" $L/check/*.log 2>/dev/null | sed 's/same-block.*corrupted/corrupted/; s/cross-stream.*->/->/' | head -20
for i in 1 2 3; do
  THREADS_BENCH_CALLS=1 THREADS_BENCH_ONLY=gpupool timeout 60 ./build-gpu/threads_bench 200000 > $L/tb_calls_$i.log 2>&1; echo "== run $i rc=$?"
  grep -E "own stream" $L/tb_calls_$i.log | grep -E "churn|serving" | grep -E "16:|\| 16 \||\| 1 \|"
done
tar czf $O/logs.tgz -C $O logs && rm -rf $L
