#!/usr/bin/env bash
# Session 37: every GPU run's parts (session 36's script; vmmcosts, offsetmap and opcost added), in calls of
# the device tool (10 minutes each); the commits are in the README. Run from anywhere:
# `docs/results/2026-11-28-s37/run.sh PART...`. Parts, any number in one call:
#   pytest1 / pytest2  the Python tests in two halves (test_torch.py; the rest)
#   ctest              every C test, example and GPU test but the 16x16 split stress
#   share              scripts/share_check.py --tensors 1000: native, split, arena (or SHARE_ALLOCS), SHARE_ROUNDS
#                      rounds (default 3; full lines in $OUT/share.jsonl, or share-$SHARE_TAG.jsonl); SHARE_FLAGS: share_check's
#                      flags (--pickle-first ...); an allocator NAME-noahead is NAME with GPUPOOL_SHARE_AHEAD=0,
#                      NAME-cfN is NAME with GPUPOOL_ARENA_CHUNK_FROM=NMiB, NAME-before is NAME under dist/before's library
#   pymulti            tests/python/test_multi_gpu.py (two GPUs: kind nvidia-h200-x2)
#   pyshare            the sharing tests (test_share.py; test_torch.py's and test_cupy.py's sharing and ordered-sends tests)
#   tball              threads_bench, every allocator (gpupool's two pools, RMM's resources, cudaMallocAsync),
#                      own streams, TB_ROUNDS rounds (default 1; 100,000 pairs a thread)
#   tbrows             threads_bench, own streams, 1 MiB pairs and churn at 1/4/16 threads,
#                      split and arena alternating, five rounds (100,000 pairs a thread)
#   bench W R          the workload benchmark, workloads W (comma list), five allocators (or BENCH_ALLOCATORS), --rounds R
#                      (BENCH_SEED=N: another draw of shapes and arrivals, its files named -seedN)
#   tbserve            threads_bench, own streams, the serving row (buffers grown by reallocation) at 1/4/16 threads,
#                      split and arena alternating, TB_ROUNDS rounds (default 5; 100,000 pairs a thread)
#   tbab               threads_bench on own streams, the arena only, every workload (1 MiB pairs, churn,
#                      serving) at 1/4/16 threads, this library and the one before alternating, TB_ROUNDS
#                      rounds (default 3; 100,000 pairs a thread)
#   tbrealloc          threads_bench's realloc (serving) row alone, one process a row (so the peaks printed
#                      are the row's): split, the arena, the arena before; 1/4/16 threads; TB_ROUNDS (default 3)
#   benchab W R        workloads W, R rounds of: native, arena (this library), arena-before (the library
#                      before); one process each (bench_workloads.py run), JSON lines in $OUT/benchab-W.jsonl;
#                      AB_ARMS picks the arms (arena-pe: this library with GPUPOOL_ARENA_PIECE_ENDS=1;
#                      expandable, split)
#   tbpe               threads_bench on own streams, the arena only, every workload at 1/4/16 threads,
#                      piece ends off and on alternating, TB_ROUNDS rounds (default 3; 100,000 pairs a thread)
#   sprofile A...      units/serving_profile.py under each allocator A (torch.profiler over measured steps
#                      20-80 of serving), to $OUT/sprofile-A.txt; the totals printed
#   pyspy W A...       py-spy (native frames, PYSPY_RATE Hz (97), at most PYSPY_LIMIT s (150) each; raw collapsed stacks) over bench_workloads.py run W A for
#                      each allocator A, to $OUT/pyspy-W-A.txt (W=share: share_check.py with its consumer)
#   srounds R          units/serving_cpu_probe.py: serving, R rounds of native, arena, split (or SR_ALLOCS), one process
#                      each, with the host's speed measured in each process; JSON lines in $OUT/srounds.jsonl
#                      (SR_PIN=CPUS: every process under taskset -c CPUS)
#   cupyshare          test_cupy.py's sharing tests (an array to a child and back, split and arena; the
#                      arena's IPC) under the environment given (GPUPOOL_ARENA_CHUNK_FROM=8MiB ...)
#   chunkreport        a 256 MiB and a 16 MiB tensor under the arena, by default and with
#                      GPUPOOL_ARENA_CHUNK_FROM=8MiB: the JSON report's chunks and the status line
#   tbcf               threads_bench on own streams, the arena, churn and serving at 16 threads, by default and
#                      with GPUPOOL_ARENA_CHUNK_FROM=8MiB alternating, TB_ROUNDS rounds (default 2)
#   grantcosts         units/grant_costs.c: what an access grant costs by what it covers, and parts of one
#                      range granted by several threads at once
#   vmmcosts           units/vmm_costs.c: each VMM call of a granule by the allocation's properties (plain,
#                      POSIX fd, + GPUDirect RDMA), and imports and creates by 1/2/4 threads at once
#   offsetmap          units/offset_map.c: does the driver map part of an allocation (at an offset, or a prefix)
#   opcost R           units/torch_op_cost.py: an allocation and free through PyTorch, native / split / arena
#                      alternating, R rounds, one process each (JSON lines in $OUT/opcost.jsonl)
#   traces W S         GPUPOOL_TRACE recordings of workloads W (comma list) under the arena, BENCH_SEED each of S
#                      (comma list), xz-compressed into $OUT/traces/W-seedS.csv.xz, for gpupool-replay
set -uo pipefail
cd "$(dirname "$0")/../../.."
export GPUPOOL_LIBRARY=$PWD/dist/libgpupool.so PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD/python:/tmp/site
nvidia-smi -L | tee $OUT/device.txt
build_before() {
  [ -x build-before/threads_bench ] && return
  cmake -S . -B build-before -DGPUPOOL_LIBRARY=$PWD/dist/before/libgpupool.so -DCMAKE_BUILD_TYPE=Release > /tmp/cmake-before.log 2>&1 \
    && cmake --build build-before -j16 --target threads_bench >> /tmp/cmake-before.log 2>&1 || tail -20 /tmp/cmake-before.log
}
build() {
  [ -x build-gpu/threads_bench ] && return
  # RMM's rows need the librmm and rapids_logger wheels unpacked above (.whl/).
  RMM=(); [ -d /tmp/site/librmm ] && RMM=(-DGPUPOOL_RMM_ROOT=/tmp/site/librmm -DGPUPOOL_RAPIDS_LOGGER_ROOT=/tmp/site/rapids_logger)
  cmake -S . -B build-gpu -DGPUPOOL_LIBRARY=$PWD/dist/libgpupool.so -DCMAKE_BUILD_TYPE=Release "${RMM[@]}" > /tmp/cmake.log 2>&1 \
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
      if [ $part = share ]; then ROUNDS=$(seq 1 ${SHARE_ROUNDS:-3}); FLAGS=("${SHARE_FLAGS:-}"); else ROUNDS="1 2"; FLAGS=("--check-parts" "--warm-consumer" "--check-parts --warm-consumer" "--check-after-all --warm-consumer --check-parts"); fi
      # PARTS_ONLY=N: only the Nth of those flag sets (1-based)
      [ -n "${PARTS_ONLY:-}" ] && FLAGS=("${FLAGS[$((PARTS_ONLY - 1))]}")
      for F in "${FLAGS[@]}"; do
        for round in $ROUNDS; do
          [ $part = parts ] && [ "$F" != --warm-consumer ] && [ $round = 2 ] && continue
          for a in ${SHARE_ALLOCS:-native split arena}; do
            # NAME-noahead: gpupool's NAME pool with GPUPOOL_SHARE_AHEAD=0 (sends opened by their rebuilds)
            # NAME-cfN: gpupool's NAME pool with GPUPOOL_ARENA_CHUNK_FROM=NMiB (both processes);
            # the suffixes in either order (arena-cf8-noahead, arena-noahead-cf8); NAME-before: the library in dist/before
            AH=1; [ "${a/-noahead/}" != "$a" ] && AH=0
            LIBV=$PWD/dist/libgpupool.so; [ "${a/-before/}" != "$a" ] && LIBV=$PWD/dist/before/libgpupool.so
            base=${a/-noahead/}; base=${base/-before/}; CF=(-u GPUPOOL_ARENA_CHUNK_FROM)
            if [[ $base =~ ^(.*)-cf([0-9]+)$ ]]; then base=${BASH_REMATCH[1]}; CF=(GPUPOOL_ARENA_CHUNK_FROM=${BASH_REMATCH[2]}MiB); fi
            GPUPOOL_LIBRARY=$LIBV GPUPOOL_SHARE_AHEAD=$AH env "${CF[@]}" timeout 150 python3 scripts/share_check.py --allocator $base --tensors 1000 $F 2>&1 | tail -1 \
              | sed "s/\"allocator\": \"$base\"/\"allocator\": \"$a\"/" | tee -a $OUT/$part${SHARE_TAG:+-$SHARE_TAG}.jsonl \
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
    pymulti)
      # the tests that need two GPUs (peer copies, a 2-rank DDP job over NCCL) on the default pool
      python3 -m pytest -v -rs tests/python/test_multi_gpu.py 2>&1 | tee $OUT/pymulti.log | grep -E "FAILED|ERROR|passed|failed|SKIP" | tail -20 ;;
    pyshare)
      python3 -m pytest -v -rs tests/python/test_share.py tests/python/test_torch.py tests/python/test_cupy.py -k "share or multiprocessing or ipc or queued_writes or without_gpupool" 2>&1 \
        | tee $OUT/pyshare.log | grep -E "FAILED|ERROR|passed|failed" | tail -20 ;;
    tball)
      build
      grep -h "gpupool:.*RMM" /tmp/cmake.log
      for round in $(seq 1 ${TB_ROUNDS:-1}); do
        THREADS_BENCH_STREAMS=own ./build-gpu/threads_bench 100000 2>&1 | grep "^|" | sed "s/^/$round /"
      done | tee $OUT/tball.log ;;
    tbrows)
      build
      for round in 1 2 3 4 5; do
        for k in gpupool gpupool-arena; do
          for w in pairs churn; do
            THREADS_BENCH_ONLY=$k THREADS_BENCH_WORKLOAD=$w THREADS_BENCH_STREAMS=own ./build-gpu/threads_bench 100000 2>&1 | grep "^| gpupool" | sed "s/^/$round /"
          done
        done
      done | tee $OUT/tbrows.log ;;
    tbserve)
      build
      for round in $(seq 1 ${TB_ROUNDS:-5}); do
        for k in gpupool gpupool-arena; do
          THREADS_BENCH_ONLY=$k THREADS_BENCH_WORKLOAD=serving THREADS_BENCH_STREAMS=own ./build-gpu/threads_bench 100000 2>&1 | grep "^| gpupool" | sed "s/^/$round /"
        done
      done | tee $OUT/tbserve.log ;;
    tbab)
      build; build_before
      for round in $(seq 1 ${TB_ROUNDS:-3}); do
        for b in build-gpu build-before; do
          THREADS_BENCH_ONLY=gpupool-arena THREADS_BENCH_STREAMS=own ./$b/threads_bench 100000 2>&1 | grep "^| gpupool" | sed "s/^/$round $b /"
        done
      done | tee $OUT/tbab.log ;;
    tbpe)
      build
      for round in $(seq 1 ${TB_ROUNDS:-3}); do
        for pe in 0 1; do
          GPUPOOL_ARENA_PIECE_ENDS=$pe THREADS_BENCH_ONLY=gpupool-arena THREADS_BENCH_STREAMS=own ./build-gpu/threads_bench 100000 2>&1 | grep "^| gpupool" | sed "s/^/$round pe=$pe /"
        done
      done | tee $OUT/tbpe.log ;;
    tbrealloc)
      build; build_before
      for round in $(seq 1 ${TB_ROUNDS:-3}); do
        for kb in gpupool:build-gpu gpupool-arena:build-gpu gpupool-arena:build-before; do
          for th in 1 4 16; do
            THREADS_BENCH_CALLS=1 THREADS_BENCH_THREADS=$th THREADS_BENCH_ONLY=${kb%%:*} THREADS_BENCH_WORKLOAD=serving THREADS_BENCH_STREAMS=own \
              ./${kb##*:}/threads_bench 100000 2>&1 | grep -E "^calls|^\| gpupool" | sed "s/^/$round ${kb##*:} /"
          done
        done
      done | tee $OUT/tbrealloc.log ;;
    benchab)
      W=$1; R=$2; shift 2
      for round in $(seq 1 $R); do
        for w in ${W//,/ }; do
          for a in ${AB_ARMS:-native arena arena-before}; do
            LIBV=$PWD/dist/libgpupool.so; [ $a = arena-before ] && LIBV=$PWD/dist/before/libgpupool.so
            PE=0; [ $a = arena-pe ] && PE=1
            base=${a%-before}; base=${base%-pe}
            POOLV=; [ $base = arena ] || [ $base = split ] && POOLV=$base
            GPUPOOL_ARENA_PIECE_ENDS=$PE GPUPOOL_LIBRARY=$LIBV GPUPOOL_POOL=$POOLV timeout 300 python3 scripts/bench_workloads.py run $w $base 2>/tmp/benchab.err | tail -1 \
              | python3 -c "
import json, sys
raw = sys.stdin.read()
try:
    r = json.loads(raw)
except ValueError:
    sys.exit(print('$w $a round $round: no result', raw[-300:], open('/tmp/benchab.err').read()[-500:]))
r['allocator'], r['round'], r['workload'] = '$a', $round, '$w'
open('$OUT/benchab-${W//,/-}.jsonl', 'a').write(json.dumps(r) + '\n')
print('$w $a round $round:', {k: r.get(k) for k in ('reserved_over_allocated', 'reserved_over_requested', 'step_ms_median', 'tokens_per_s', 'calls_per_step_second_half', 'calls_per_step_second_half_off_peak', 'fingerprint_sha256')})"
          done
        done
      done ;;
    bench)
      W=$1; R=$2; shift 2
      python3 scripts/bench_workloads.py all --workloads $W --allocators ${BENCH_ALLOCATORS:-native,expandable,rmm,split,arena} --rounds $R \
        --out $OUT/bench-${W//,/-}${BENCH_SEED:+-seed$BENCH_SEED}.jsonl 2>&1 | tee $OUT/bench-${W//,/-}${BENCH_SEED:+-seed$BENCH_SEED}.log | grep -v "step [0-9]*/\|/[0-9]*: step" | tail -30 ;;

    sprofile)
      while [ $# -gt 0 ] && [ "${1#-}" = "$1" ] && [ -n "$(echo "$1" | grep -E '^(native|expandable|split|arena)$')" ]; do
        a=$1; shift
        timeout 300 python3 docs/results/2026-11-28-s32/units/serving_profile.py $a > $OUT/sprofile-$a.txt 2>/tmp/sprofile-$a.err \
          || tail -5 /tmp/sprofile-$a.err
        head -14 $OUT/sprofile-$a.txt
      done ;;
    pyspy)
      W=$1; shift
      while [ $# -gt 0 ] && [ -n "$(echo "$1" | grep -E '^(native|expandable|split|arena)$')" ]; do
        a=$1; shift
        if [ $W = share ]; then CMD=(scripts/share_check.py --allocator $a --tensors 1000); else CMD=(scripts/bench_workloads.py run $W $a); fi
        GPUPOOL_POOL=$( [ $a = native ] || echo $a ) timeout ${PYSPY_LIMIT:-150} /tmp/site/bin/py-spy record --native --subprocesses -r ${PYSPY_RATE:-97} --format raw \
          -o $OUT/pyspy-$W-$a.txt -- python3 "${CMD[@]}" > /tmp/pyspy-$a.out 2>/tmp/pyspy-$a.err || tail -5 /tmp/pyspy-$a.err
        tail -c 400 /tmp/pyspy-$a.out; echo; ls -la $OUT/pyspy-$W-$a.txt
      done ;;
    srounds)
      R=$1; shift
      for round in $(seq 1 $R); do
        for a in ${SR_ALLOCS:-native arena split}; do
          PIN=(); [ -n "${SR_PIN:-}" ] && PIN=(taskset -c $SR_PIN)
          timeout 200 "${PIN[@]}" python3 docs/results/2026-11-28-s32/units/serving_cpu_probe.py $a 2>/tmp/sr.err | tail -1 | python3 -c "
import json, sys
raw = sys.stdin.read()
try:
    r = json.loads(raw)
except ValueError:
    sys.exit(print('$a round $round: no result', raw[-300:], open('/tmp/sr.err').read()[-500:]))
r['round'] = $round
open('$OUT/srounds.jsonl', 'a').write(json.dumps(r) + '\\n')
print('$a round $round:', {k: round(r[k], 3) if isinstance(r.get(k), float) else r.get(k) for k in ('tokens_per_s', 'step_ms_median', 'py_loop_ms', 'launch_us', 'reserved_over_allocated', 'fingerprint_sha256')})"
        done
      done ;;
    grantcosts)
      gcc -O2 docs/results/2026-11-28-s36/units/grant_costs.c -I/usr/local/cuda/include -L/usr/local/cuda/lib64/stubs -lcuda -lpthread -o /tmp/grant_costs \
        && /tmp/grant_costs 2>&1 | tee $OUT/grantcosts.log ;;
    vmmcosts)
      gcc -O2 docs/results/2026-11-28-s37/units/vmm_costs.c -I/usr/local/cuda/include -L/usr/local/cuda/lib64/stubs -lcuda -lpthread -o /tmp/vmm_costs \
        && /tmp/vmm_costs 2>&1 | tee $OUT/vmmcosts.log ;;
    offsetmap)
      gcc -O2 docs/results/2026-11-28-s37/units/offset_map.c -I/usr/local/cuda/include -L/usr/local/cuda/lib64/stubs -lcuda -o /tmp/offset_map \
        && /tmp/offset_map 2>&1 | tee $OUT/offsetmap.log ;;
    opcost)
      for round in $(seq 1 ${1:-4}); do
        for a in native split arena; do
          timeout 120 python3 docs/results/2026-11-28-s37/units/torch_op_cost.py $a 2>&1 | tail -1 | tee -a $OUT/opcost.jsonl
        done
      done; shift ;;
    cupyshare)
      python3 -m pytest -v -rs tests/python/test_cupy.py -k "share or ipc" 2>&1 | tee $OUT/cupyshare.log | grep -E "FAILED|ERROR|passed|failed|SKIP" | tail -20 ;;
    chunkreport)
      for cf in default 8MiB; do
        CF=(-u GPUPOOL_ARENA_CHUNK_FROM); [ $cf = default ] || CF=(GPUPOOL_ARENA_CHUNK_FROM=$cf)
        env "${CF[@]}" GPUPOOL_POOL=arena python3 -c "
import json, torch, gpupool, gpupool.torch
gpupool.torch.install()
a = torch.empty(256 << 20, dtype=torch.uint8, device='cuda')
b = torch.empty(16 << 20, dtype=torch.uint8, device='cuda')
s = gpupool.stats_json(0)
print('chunk_from=$cf', json.dumps({k: s['arena'].get(k) for k in ('chunks', 'chunk_bytes', 'granules_mapped')}), s['driver_calls'].get('mem_create'))
print([l for l in gpupool.memory_status(0).splitlines() if 'chunk' in l])
" 2>&1 | tail -3 | tee -a $OUT/chunkreport.log
      done ;;
    tbcf)
      build
      for round in $(seq 1 ${TB_ROUNDS:-2}); do
        for cf in default 8MiB; do
          CF=(-u GPUPOOL_ARENA_CHUNK_FROM); [ $cf = default ] || CF=(GPUPOOL_ARENA_CHUNK_FROM=$cf)
          for w in churn serving; do
            env "${CF[@]}" THREADS_BENCH_THREADS=16 THREADS_BENCH_ONLY=gpupool-arena THREADS_BENCH_WORKLOAD=$w THREADS_BENCH_STREAMS=own \
              ./build-gpu/threads_bench 100000 2>&1 | grep "^| gpupool" | sed "s/^/$round cf=$cf /"
          done
        done
      done | tee $OUT/tbcf.log ;;
    traces)
      W=$1; S=$2; shift 2
      mkdir -p $OUT/traces
      for w in ${W//,/ }; do
        for s in ${S//,/ }; do
          BENCH_SEED=$s GPUPOOL_TRACE=/tmp/$w-$s.csv GPUPOOL_POOL=arena timeout 300 python3 scripts/bench_workloads.py run $w arena > /tmp/$w-$s.json 2>/tmp/$w-$s.err \
            || tail -5 /tmp/$w-$s.err
          python3 -c "import json;r=json.load(open('/tmp/$w-$s.json'));print('$w seed $s:',r['step_ms_median'],r['reserved_over_allocated'],r['calls_per_step_second_half'])"
          xz -T16 -6 -c /tmp/$w-$s.csv > $OUT/traces/$w-seed$s.csv.xz && rm /tmp/$w-$s.csv
        done
      done ;;
  esac
done
