#!/usr/bin/env bash
# Session 25: every GPU run's parts, in calls of the device tool (10 minutes
# each); the library is dist/libgpupool.so as built for each run (the commits are in the
# README). Run from anywhere: `docs/results/2026-11-26-s25/run.sh PART...`. Parts, any number in one call:
#   pytest1 / pytest2  the Python tests in two halves (test_torch.py; the rest)
#   ctest              every C test, example and GPU test but the 16x16 split stress
#   share1             scripts/share_check.py --tensors 1000: native, split, arena once, the arena profiled (run A)
#   share              the same, three rounds; then the arena profiled, with each handover's fetch time
#                      (runs B and C printed no fetch times: the consumer recorded none before 7aaa445)
#   diag               share_check.py on the arena with the import-timing library (dist/libgpupool-diag.so)
#   pyshare            the sharing tests (test_share.py; test_torch.py's and test_cupy.py's sharing tests)
#   tbrows             threads_bench, own streams, 1 MiB pairs and churn at 1/4/16 threads,
#                      split and arena alternating, five rounds (100,000 pairs a thread)
#   tball              threads_bench, every allocator (RMM's, cudaMallocAsync), own streams, one round
#   vmm                units/vmm_costs.c: what cuMemSetAccess, cuMemImportFromShareableHandle, cuMemMap cost by size
#   spans              units/spans.py: share_check's producer layout, what a consumer imports (default library, then
#                      dist/libgpupool-chunk4.so: units/one_chunk_from_4mib.patch, one allocation per growth from 4 MiB)
#   sharec4            share_check.py three rounds of native, arena, arena with dist/libgpupool-chunk4.so
#   ordered            test_torch.py's ordered-sends script with the consumer's waits removed (`nowait`), on
#                      split and arena: it must fail (shows the test can)
#   split              units/loads_split.py: the receiver's rebuild timed in parts (arena, three runs)
#   bench W            the workload benchmark, workloads W (comma list), five allocators, --rounds R
set -uo pipefail
cd "$(dirname "$0")/../../.."
export GPUPOOL_LIBRARY=$PWD/dist/libgpupool.so PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD/python:/tmp/site
nvidia-smi -L
build() {
  [ -x build-gpu/threads_bench ] && return
  cmake -S . -B build-gpu -DGPUPOOL_LIBRARY=$PWD/dist/libgpupool.so -DCMAKE_BUILD_TYPE=Release > /tmp/cmake.log 2>&1 \
    && cmake --build build-gpu -j16 >> /tmp/cmake.log 2>&1 || tail -20 /tmp/cmake.log
}
while [ $# -gt 0 ]; do
  part=$1; shift
  echo "== $part $(date +%T)"
  case "$part" in
    pytest1|pytest2)
      if [ "$part" = pytest1 ]; then F=tests/python/test_torch.py; else F=$(ls tests/python/test_*.py | grep -v test_torch.py); fi
      python3 -m pytest -v -rs $F 2>&1 | tee $OUT/$part.log | grep -E "FAILED|ERROR|passed|failed" | tail -20 ;;
    ctest)
      build
      ctest --test-dir build-gpu --output-on-failure --timeout 300 -E 16x16_split 2>&1 | tee $OUT/ctest.log | tail -6 ;;
    share1)
      for a in native split arena; do
        P=""; [ $a = arena ] && P="--profile $OUT"
        timeout 150 python3 scripts/share_check.py --allocator $a --tensors 1000 $P 2>&1 | tail -1 | cut -c1-900
      done | tee $OUT/share.log ;;
    share)
      for round in 1 2 3; do
        for a in native split arena; do
          timeout 150 python3 scripts/share_check.py --allocator $a --tensors 1000 2>&1 | tail -1 | cut -c1-900
        done
      done | tee $OUT/share.log
      timeout 150 python3 scripts/share_check.py --allocator arena --tensors 1000 --profile $OUT 2>&1 | tail -1 | cut -c1-300; cat $OUT/consumer-fetch-ms-arena.txt ;;
    diag)
      # The library with timers around the consumer's import calls (units/import_timing.patch),
      # printed by each process at exit; unprofiled, then profiled.
      for P in "" "--profile $OUT"; do
        GPUPOOL_LIBRARY=$PWD/dist/libgpupool-diag.so timeout 150 python3 scripts/share_check.py --allocator arena --tensors 1000 $P \
          > $OUT/diag.log 2>&1; grep -E "gpupool diag|tensors_per_s" $OUT/diag.log | cut -c1-700
      done | tee $OUT/diag-summary.log ;;
    pyshare)
      python3 -m pytest -v -rs tests/python/test_share.py tests/python/test_torch.py tests/python/test_cupy.py -k "share or multiprocessing or ipc" 2>&1 \
        | tee $OUT/pyshare.log | grep -E "FAILED|ERROR|passed|failed" | tail -20 ;;
    tbrows)
      build
      for round in 1 2 3 4 5; do
        for k in gpupool gpupool-arena; do
          for w in pairs churn; do
            THREADS_BENCH_ONLY=$k THREADS_BENCH_WORKLOAD=$w THREADS_BENCH_STREAMS=own ./build-gpu/threads_bench 100000 2>&1 | grep "^| gpupool" | sed "s/^/$round /"
          done
        done
      done | tee $OUT/tbrows.log ;;
    tball)
      build
      THREADS_BENCH_STREAMS=own ./build-gpu/threads_bench 100000 2>&1 | tee $OUT/tball.log | grep "^|" ;;
    vmm)
      gcc -O2 docs/results/2026-11-26-s25/units/vmm_costs.c -I/usr/local/cuda/include -L/usr/local/cuda/lib64/stubs -lcuda -o /tmp/vmm_costs \
        && /tmp/vmm_costs 2>&1 | tee $OUT/vmm.log ;;
    spans)
      for L in dist/libgpupool.so dist/libgpupool-chunk4.so; do
        echo "-- $L"; GPUPOOL_LIBRARY=$PWD/$L timeout 120 python3 docs/results/2026-11-26-s25/units/spans.py 2>&1 | tail -3
      done | tee $OUT/spans.log ;;
    sharec4)
      for round in 1 2 3; do
        for a in native arena chunk4; do
          if [ $a = chunk4 ]; then
            GPUPOOL_LIBRARY=$PWD/dist/libgpupool-chunk4.so timeout 150 python3 scripts/share_check.py --allocator arena --tensors 1000 2>&1 | tail -1 | sed 's/"arena"/"arena-chunk4"/' | cut -c1-300
          else
            timeout 150 python3 scripts/share_check.py --allocator $a --tensors 1000 2>&1 | tail -1 | cut -c1-900
          fi
        done
      done | tee $OUT/sharec4.log ;;
    ordered)
      python3 -c "import sys; sys.path.insert(0, 'tests/python'); import test_torch; open('/tmp/ordered.py', 'w').write(test_torch.ORDERED_SENDS)"
      # bb1c4cf's route (one record per message, at its first send): units/torch_first_record_only.patch
      # on today's torch.py (runs E and J ran bb1c4cf's file, which the patch gives back)
      rm -rf /tmp/first && mkdir -p /tmp/first && cp -r python/gpupool /tmp/first/ \
        && patch -s /tmp/first/gpupool/torch.py < docs/results/2026-11-26-s25/units/torch_first_record_only.patch
      for pool in split arena; do
        echo "-- $pool, waits removed (must fail):"; timeout 120 python3 /tmp/ordered.py $pool nowait 2>&1 | tail -2
        echo "-- $pool, one record per message, at its first send (must fail):"
        PYTHONPATH=/tmp/first:$PYTHONPATH timeout 120 python3 /tmp/ordered.py $pool 2>&1 | tail -2
        echo "-- $pool, as shipped:"; timeout 120 python3 /tmp/ordered.py $pool 2>&1 | tail -2
      done | tee $OUT/ordered.log ;;
    split)
      for round in 1 2 3; do
        timeout 150 python3 docs/results/2026-11-26-s25/units/loads_split.py --allocator arena --tensors 1000 2>&1 | grep -E "loads split|tensors_per_s" | cut -c1-600
      done | tee $OUT/split.log ;;
    bench)
      W=$1; R=$2; shift 2
      python3 scripts/bench_workloads.py all --workloads $W --allocators native,expandable,rmm,split,arena --rounds $R \
        --out $OUT/bench-${W//,/-}.jsonl 2>&1 | tee $OUT/bench-${W//,/-}.log | grep -v "step [0-9]*/\|/[0-9]*: step" | tail -30 ;;
  esac
done
