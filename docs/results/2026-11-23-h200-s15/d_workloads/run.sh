#!/usr/bin/env bash
# Session 15, run D: the workload benchmark with every column of #14's table (RMM's pool included), one process per allocator.
set -uo pipefail
O=${OUT:-/tmp/o}; mkdir -p $O
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > $O/pip.log 2>&1; echo pip rc=$?
export PYTHONPATH=/tmp/site:$PWD/python GPUPOOL_LIBRARY=$PWD/dist/libgpupool.so PYTHONUNBUFFERED=1
timeout 575 python3 scripts/bench_workloads.py all --workloads training,churn,serving --allocators native,expandable,rmm,split,arena --out $O/w.jsonl > $O/workloads.log 2>&1; echo rc=$?
sed -n '/^### /,$p' $O/workloads.log; grep -i "error\|rmm:" $O/workloads.log | head
