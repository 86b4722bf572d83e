#!/usr/bin/env bash
# Session 19, run D: the GPU check on the final library (arena default, sharded; exported
# blocks keep their granules; the hardening of this session: unmap/release books, fence
# failures, out-of-memory text, configuration warnings). Every test but the 2-minute split
# 16x16 stress.
set -uo pipefail
cd "$(dirname "$0")/../../../.."
export PYTHONUNBUFFERED=1
SKIP_BENCH=1 CTEST_EXCLUDE=16x16_split scripts/gpu_check.sh $OUT/check > $OUT/check.log 2>&1
sed -n '/SUMMARY/,$p' $OUT/check.log | grep -v "PASSED$"
grep -E "^stream_stress pool=arena|ipc|FAIL" $OUT/check/ctest-full.log | head -20
