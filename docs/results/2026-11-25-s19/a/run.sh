#!/usr/bin/env bash
# Session 19, run A: the token-budget workload beside the anchors (before any arena change),
# and GPUPOOL_TRACE recordings of every workload under the arena, for gpupool-replay.
set -uo pipefail
cd "$(dirname "$0")/../../../.."
export GPUPOOL_LIBRARY=$PWD/dist/libgpupool.so PYTHONUNBUFFERED=1
nvidia-smi -L
python3 scripts/bench_workloads.py all --workloads tokens --allocators native,expandable,split,arena \
  --out $OUT/tokens.jsonl 2>&1 | tee $OUT/tokens.log | grep -v "step [0-9]*/" 
for w in tokens training churn serving; do
  GPUPOOL_TRACE=/tmp/$w.csv GPUPOOL_POOL=arena python3 scripts/bench_workloads.py run $w arena > /tmp/$w.json 2>/tmp/$w.err
  python3 -c "import json;r=json.load(open('/tmp/$w.json'));print('$w traced:',r['step_ms_median'],r['reserved_over_allocated'],r['driver_calls'] and r['driver_calls']['total'],r['calls_per_step_second_half'])"
  wc -l /tmp/$w.csv
  xz -T16 -6 -c /tmp/$w.csv > $OUT/$w.csv.xz
  cat /tmp/$w.json >> $OUT/traced.jsonl
done
ls -la $OUT
