#!/usr/bin/env bash
# Session 16, run D: the GPU check with the new event-batch defaults (the stream-safety
# stresses: stream_stress, CuPy non-blocking streams, graphs).
set -uo pipefail
O=${OUT:-/tmp/o}; mkdir -p $O
SKIP_BENCH=1 CTEST_EXCLUDE=16x16 timeout 420 scripts/gpu_check.sh $O/check > $O/check.log 2>&1; echo "check rc=$?"
grep -E "GPU CHECK|tests passed|^stream_stress|corrupt" $O/check.log | head -20
tail -3 $O/check/pytest.log
