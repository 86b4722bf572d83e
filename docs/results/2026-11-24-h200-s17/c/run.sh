#!/usr/bin/env bash
# Session 17, run C: two more gpupool-alone threads_bench runs at 200,000 pairs (more samples of
# 16 threads against one), and the churn workload, arena against native.
set -uo pipefail
O=${OUT:-/tmp/o}; mkdir -p $O
# (A fresh machine has no build-gpu: build threads_bench alone, gpupool only.)
[ -x build-gpu/threads_bench ] || { cmake -S . -B build-gpu -DGPUPOOL_LIBRARY=$PWD/dist/libgpupool.so -DCMAKE_BUILD_TYPE=Release > $O/build.log 2>&1 && cmake --build build-gpu -j16 --target threads_bench >> $O/build.log 2>&1 || { tail -20 $O/build.log; exit 1; }; }
for i in 4 5; do
  THREADS_BENCH_ONLY=gpupool timeout 60 ./build-gpu/threads_bench 200000 > $O/tb_gpupool_200k_$i.log 2>&1; echo "== gpupool 200k run $i rc=$?"; grep "own stream" $O/tb_gpupool_200k_$i.log
done
export PYTHONPATH=$PWD/python GPUPOOL_LIBRARY=$PWD/dist/libgpupool.so PYTHONUNBUFFERED=1
[ -n "${SKIP_WORKLOADS:-}" ] || timeout 200 python3 scripts/bench_workloads.py all --workloads churn --allocators native,arena --out $O/w.jsonl > $O/workloads.log 2>&1; echo "workloads rc=$?"
sed -n '/^### /,$p' $O/workloads.log
