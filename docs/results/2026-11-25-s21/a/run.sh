#!/usr/bin/env bash
# Session 21, run A (2 x H100, library a132c2f = main at the session's start): the two-GPU
# tests (peer copies both ways, a 2-rank torchrun DDP job over NCCL) on split and on the
# arena, the default pool, then the multi-GPU-relevant part of ctest.
set -u
export GPUPOOL_LIBRARY=$PWD/dist/libgpupool.so PYTHONUNBUFFERED=1
nvidia-smi -L > "$OUT/gpus.log" 2>&1
nvidia-smi topo -m >> "$OUT/gpus.log" 2>&1
timeout 400 python3 -m pytest -v -rs tests/python/test_multi_gpu.py > "$OUT/multi_gpu.log" 2>&1
echo "pytest rc=$?" >> "$OUT/multi_gpu.log"
# With no GPUPOOL_POOL set, the strategy a process gets (the default).
PYTHONPATH=$PWD/python timeout 60 python3 -c "
import json, torch, gpupool
gpupool.torch.install()
x = torch.ones(1 << 20, device='cuda:0'); y = torch.ones(1 << 20, device='cuda:1')
for d in (0, 1):
    s = gpupool.stats_json(d)
    s = s[0] if isinstance(s, list) else s.get('devices', [s])[0] if 'devices' in s else s
    print('device', d, 'strategy', s.get('strategy'), 'memory', (s.get('arena') or {}).get('memory'))
" > "$OUT/default.log" 2>&1
echo "rc=$?" >> "$OUT/default.log"
tail -15 "$OUT/multi_gpu.log"; cat "$OUT/default.log"
