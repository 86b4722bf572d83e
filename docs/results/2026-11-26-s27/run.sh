#!/usr/bin/env bash
# Session 27: every GPU run's parts (session 26's script, parts added), in calls of the device tool (10 minutes
# each); the library is dist/libgpupool.so as built for each run (the commits are in the
# README). Run from anywhere: `docs/results/2026-11-26-s27/run.sh PART...`. Parts, any number in one call:
#   pytest1 / pytest2  the Python tests in two halves (test_torch.py; the rest)
#   ctest              every C test, example and GPU test but the 16x16 split stress
#   share              scripts/share_check.py --tensors 1000: native, split, arena (or SHARE_ALLOCS; NAME-noahead:
#                      GPUPOOL_SHARE_AHEAD=0), SHARE_ROUNDS rounds (default 3; full lines in $OUT/share.jsonl)
#   parts              the same with --check-parts (the consumer's check in parts), one round; then with
#                      --warm-consumer (its own pool grown before the clock starts), two rounds; both; and
#                      both with --check-after-all (PARTS_ONLY=N picks the Nth of these four)
#   prof               share_check.py --profile, one round of each of SHARE_ALLOCS (default arena arena-noahead)
#   shareold           share_check.py rounds of native, split, arena, and arena with the Python package of
#                      dist/oldpy (the commit before: one record per send), SHARE_ROUNDS rounds (default 5)
#   overlap            units/vmm_overlap.c: a receiver's imports on a thread of their own beside main-thread work
#   vmmthreads         units/vmm_threads.c: a receiver's imports and access grants split over 1-8 threads
#   native             test_torch.py's script for tensors from a process without gpupool, with PyTorch's own
#                      receiving function (`unrouted`: must fail), then as shipped, on split and arena
#   ops                units/torch_ops.py: one small PyTorch operation's CPU cost under each allocator
#   ptimes             units/pattern_times.py: the consumer's check in one process, by tensor size
#   touch              units/first_touch.py: torch.equal over received tensors, three passes, then clones
#   pyshare            the sharing tests (test_share.py; test_torch.py's and test_cupy.py's sharing and ordered-sends tests)
#   tbrows             threads_bench, own streams, 1 MiB pairs and churn at 1/4/16 threads,
#                      split and arena alternating, five rounds (100,000 pairs a thread)
#   tball              threads_bench, every allocator (RMM's, cudaMallocAsync), own streams, one round
#   bench W R          the workload benchmark, workloads W (comma list), five allocators (or BENCH_ALLOCATORS), --rounds R
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
    share|parts)
      if [ $part = share ]; then ROUNDS=$(seq 1 ${SHARE_ROUNDS:-3}); FLAGS=(""); else ROUNDS="1 2"; FLAGS=("--check-parts" "--warm-consumer" "--check-parts --warm-consumer" "--check-after-all --warm-consumer --check-parts"); fi
      # PARTS_ONLY=N: only the Nth of those flag sets (1-based)
      [ -n "${PARTS_ONLY:-}" ] && FLAGS=("${FLAGS[$((PARTS_ONLY - 1))]}")
      for F in "${FLAGS[@]}"; do
        for round in $ROUNDS; do
          [ $part = parts ] && [ "$F" != --warm-consumer ] && [ $round = 2 ] && continue
          for a in ${SHARE_ALLOCS:-native split arena}; do
            # NAME-noahead: gpupool's NAME pool with GPUPOOL_SHARE_AHEAD=0 (sends opened by their rebuilds)
            AH=1; [ "${a%-noahead}" != "$a" ] && AH=0
            GPUPOOL_SHARE_AHEAD=$AH timeout 150 python3 scripts/share_check.py --allocator ${a%-noahead} --tensors 1000 $F 2>&1 | tail -1 \
              | sed "s/\"allocator\": \"${a%-noahead}\"/\"allocator\": \"$a\"/" | tee -a $OUT/$part.jsonl \
              | python3 -c "
import json, sys
raw = sys.stdin.read()
try:
    r = json.loads(raw)
except ValueError:
    sys.exit(print('$F', 'no result:', raw[-300:]))
print('$F', {k: v for k, v in r.items() if k.startswith(('allocator', 'tensors_per', 'consumer_')) and k not in ('consumer_end', 'consumer_after_release')})"
          done
        done
      done ;;
    prof)
      # share_check.py --profile (cProfile of the producer's pickling and the consumer's receiving), one
      # round of each of SHARE_ALLOCS (NAME-noahead: GPUPOOL_SHARE_AHEAD=0); profiles in $OUT/prof-NAME/
      for a in ${SHARE_ALLOCS:-arena arena-noahead}; do
        AH=1; [ "${a%-noahead}" != "$a" ] && AH=0
        mkdir -p $OUT/prof-$a
        GPUPOOL_SHARE_AHEAD=$AH timeout 150 python3 scripts/share_check.py --allocator ${a%-noahead} --tensors 1000 \
          --profile $OUT/prof-$a 2>&1 | tail -1 | cut -c1-300
      done ;;
    shareold)
      for round in $(seq 1 ${SHARE_ROUNDS:-5}); do
        for a in native split arena arena-old; do
          PP=$PYTHONPATH; [ $a = arena-old ] && PP=$PWD/dist/oldpy:/tmp/site
          PYTHONPATH=$PP timeout 150 python3 scripts/share_check.py --allocator ${a%-old} --tensors 1000 2>&1 | tail -1 \
            | sed "s/\"allocator\": \"arena\"/\"allocator\": \"$a\"/" | tee -a $OUT/shareold.jsonl | cut -c1-200
        done
      done ;;
    overlap)
      gcc -O2 docs/results/2026-11-26-s27/units/vmm_overlap.c -I/usr/local/cuda/include -L/usr/local/cuda/lib64/stubs -lcuda -lpthread \
        -o /tmp/vmm_overlap && /tmp/vmm_overlap 2>&1 | tee $OUT/vmm_overlap.log ;;
    vmmthreads)
      gcc -O2 docs/results/2026-11-26-s26/units/vmm_threads.c -I/usr/local/cuda/include -L/usr/local/cuda/lib64/stubs -lcuda -lpthread \
        -o /tmp/vmm_threads && /tmp/vmm_threads 2>&1 | tee $OUT/vmm_threads.log ;;
    native)
      python3 -c "import sys; sys.path.insert(0, 'tests/python'); import test_torch; open('/tmp/from_native.py', 'w').write(test_torch.FROM_NATIVE)"
      for pool in split arena; do
        echo "-- $pool, PyTorch's receiving function (must fail):"; timeout 120 python3 /tmp/from_native.py $pool unrouted 2>&1 | grep -E "Error|received" | tail -2
        echo "-- $pool, as shipped:"; timeout 120 python3 /tmp/from_native.py $pool 2>&1 | tail -1
      done | tee $OUT/native.log ;;
    ops)
      for round in 1 2; do
        for a in native split split-plain arena; do
          timeout 120 python3 docs/results/2026-11-26-s26/units/torch_ops.py $a 2>&1 | tail -1
        done
      done | tee $OUT/ops.log ;;
    ptimes)
      for a in native split arena native split arena; do
        timeout 120 python3 docs/results/2026-11-26-s26/units/pattern_times.py $a 3 2>&1 | tail -3
      done | tee $OUT/ptimes.log ;;
    touch)
      for nb in 65536 1048576 8388608; do
        for a in native split arena; do
          timeout 120 python3 docs/results/2026-11-26-s26/units/first_touch.py $a 400 $nb 2>&1 | tail -1
        done
      done | tee $OUT/touch.log ;;
    pyshare)
      python3 -m pytest -v -rs tests/python/test_share.py tests/python/test_torch.py tests/python/test_cupy.py -k "share or multiprocessing or ipc or queued_writes or without_gpupool" 2>&1 \
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
    bench)
      W=$1; R=$2; shift 2
      python3 scripts/bench_workloads.py all --workloads $W --allocators ${BENCH_ALLOCATORS:-native,expandable,rmm,split,arena} --rounds $R \
        --out $OUT/bench-${W//,/-}.jsonl 2>&1 | tee $OUT/bench-${W//,/-}.log | grep -v "step [0-9]*/\|/[0-9]*: step" | tail -30 ;;
  esac
done
