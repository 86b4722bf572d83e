#!/usr/bin/env bash
# Session 19, run E: CuPy's raw route (the two C symbols installed by hand) on non-blocking
# streams, 1,000 rounds, beside the install() route and its unsafe control; the CuPy and
# helper tests.
set -uo pipefail
cd "$(dirname "$0")/../../../.."
export PYTHONUNBUFFERED=1 GPUPOOL_LIBRARY=$PWD/dist/libgpupool.so
python3 -m pytest -v -rs tests/python/test_graphs.py -k "raw_cupy or non_blocking_streams" tests/python/test_cupy.py tests/python/test_helper.py 2>&1 | tee $OUT/pytest.log | grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed"
