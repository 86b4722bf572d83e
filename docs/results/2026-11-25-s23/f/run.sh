#!/usr/bin/env bash
# Session 23, run F: the library with each descriptor once per handover (python/gpupool/share.py
# at that commit; the library itself as in run E): share_check.py --profile on the arena, the
# sharing test of test_torch.py, then share_check.py on native for the same run.
set -uo pipefail
cd "$(dirname "$0")/../../../.."
export GPUPOOL_LIBRARY=$PWD/dist/libgpupool.so PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD/python:/tmp/site
nvidia-smi -L
echo "== share arena $(date +%T)"
timeout 100 python3 scripts/share_check.py --allocator arena --tensors 1000 --profile $OUT > $OUT/share-arena.log 2>&1; tail -1 $OUT/share-arena.log | cut -c1-700
grep -E "_storage_here|detach|_fetch|recvfds|recvmsg|open_dlpack" $OUT/consumer-arena.txt | cut -c1-150
echo "== pytest sharing $(date +%T)"
python3 -m pytest -v -rs tests/python/test_torch.py -k multiprocessing 2>&1 | tee $OUT/pytest-share.log | grep -E "FAILED|ERROR|PASSED|passed|failed" | tail -6
echo "== share native $(date +%T)"
timeout 100 python3 scripts/share_check.py --allocator native --tensors 1000 > $OUT/share-native.log 2>&1; tail -1 $OUT/share-native.log | cut -c1-300
