#!/usr/bin/env bash
# Session 23, run E: the session's final library (dist/libgpupool.so, d40fd83): the Python
# tests (all but test_torch.py, then test_torch.py), and between them share_check.py
# --profile on the arena (where the producer's and the consumer's time goes).
set -uo pipefail
cd "$(dirname "$0")/../../../.."
export GPUPOOL_LIBRARY=$PWD/dist/libgpupool.so PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD/python:/tmp/site
nvidia-smi -L
echo "== pytest2 $(date +%T)"
python3 -m pytest -v -rs $(ls tests/python/test_*.py | grep -v test_torch.py) 2>&1 | tee $OUT/pytest2.log | grep -E "FAILED|ERROR|passed|failed" | tail -20
echo "== share $(date +%T)"
timeout 120 python3 scripts/share_check.py --allocator arena --tensors 1000 --profile $OUT > $OUT/share.log 2>&1; tail -3 $OUT/share.log | cut -c1-600
for f in $OUT/*-arena.txt; do echo "== $f"; sed -n 1,30p $f | cut -c1-170; done
echo "== pytest1 $(date +%T)"
python3 -m pytest -v -rs tests/python/test_torch.py 2>&1 | tee $OUT/pytest1.log | grep -E "FAILED|ERROR|passed|failed" | tail -20
