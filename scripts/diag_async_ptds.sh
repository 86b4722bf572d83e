#!/usr/bin/env bash
# Reproducer for a driver stall met earlier, run ON the GPU machine after
# scripts/gpu_check.sh built build-gpu/: worker threads that free stream-ordered memory on
# their per-thread default stream and exit without draining it leave cudaDeviceSynchronize
# spinning forever. Shown with plain cudaMallocAsync/cudaFreeAsync (STRESS_RAW=1, no gpupool)
# and through gpupool, then gone when each worker drains its stream before exiting (the
# stress test's default), for every strategy on the async upstream. A run that stalls gets
# its threads listed. Usage: scripts/diag_async_ptds.sh [ROUNDS] [SECONDS]
set -uo pipefail
ROUNDS=${1:-200}
LIMIT=${2:-60}
BIN=./build-gpu/stream_stress
run() {
  local POOL=none; for a in "$@"; do case $a in POOL=*) POOL=${a#POOL=};; esac; done
  local label=$1; shift
  echo "== $label"
  env "$@" "$BIN" "${POOL:-none}" async "$ROUNDS" > /tmp/diag.out 2>&1 &
  local pid=$! t=0
  while kill -0 $pid 2>/dev/null && [ $t -lt "$LIMIT" ]; do sleep 1; t=$((t + 1)); done
  if kill -0 $pid 2>/dev/null; then
    echo "$label: STALLED after ${LIMIT}s"
    if command -v gdb >/dev/null; then
      timeout 60 gdb -p $pid -batch -ex "thread apply all bt 12" 2>/dev/null | grep -E "^Thread|^#" | head -150
    else
      for task in /proc/$pid/task/*; do echo "$(basename "$task") $(cat "$task/wchan" 2>/dev/null) $(cat "$task/syscall" 2>/dev/null | cut -d' ' -f1)"; done
    fi
    kill -9 $pid
    echo "$label: RESULT stalled"
  else
    wait $pid; echo "$label: RESULT exit $? in ${t}s"
  fi
  tail -4 /tmp/diag.out
}
run "raw cudaMallocAsync, user + per-thread, threads exit without draining" STRESS_KINDS=1 STRESS_RAW=1 STRESS_NO_EXIT_SYNC=1
run "raw cudaMallocAsync, user + per-thread, threads drain before exit" STRESS_KINDS=1 STRESS_RAW=1
run "gpupool none/async, user + per-thread, threads exit without draining" STRESS_KINDS=1 STRESS_NO_EXIT_SYNC=1
for pool in none split binned; do
  run "gpupool $pool/async, all stream kinds, threads drain before exit" STRESS_KINDS=3 POOL=$pool
done
