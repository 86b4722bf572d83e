#!/usr/bin/env bash
# Part of scripts/gpu_check.sh: the Python tests (PyTorch, CuPy) and the benchmarks, on the
# GPU machine. Expects dist/libgpupool.so (the library built elsewhere: the GPU machine has no
# Rust toolchain; `cargo build --release && mkdir -p dist && cp target/release/libgpupool.so dist/`) and, for the
# RMM column, RMM wheels in .whl/. SKIP_BENCH=1: tests only; ONLY_BENCH=1: the benchmarks
# only (the two together pass the device's 10-minute limit per command). PYTEST_ARGS: what
# pytest runs instead of tests/python (e.g. two halves in two calls on a 2-GPU machine, where
# the two-GPU tests bring the whole set close to the limit).
# WORKLOADS=training,serving,churn: run the workload benchmark (bench/workloads/bench_workloads.py:
# memory and step time of native, expandable segments, RMM, gpupool split and arena) for
# those workloads instead of the framework churn benchmark.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-/tmp/gpupool-out}
cd "$ROOT"
export GPUPOOL_LIBRARY="$ROOT/dist/libgpupool.so" PYTHONUNBUFFERED=1
if [ ! -f "$GPUPOOL_LIBRARY" ]; then
  echo "error: $GPUPOOL_LIBRARY is missing: build it with cargo build --release and copy it to dist/" >&2
  exit 1
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -z "${ONLY_BENCH:-}" ]; then
echo "== python tests (pytest)"
python3 -m pytest -v -rs ${PYTEST_ARGS:-tests/python} 2>&1 | tee "$OUT/pytest.log"
echo "== record a trace of a real PyTorch training loop (test data for gpupool-replay)"
PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}" GPUPOOL_TRACE=/tmp/torch_mlp_trace.csv python3 scripts/record_torch_trace.py
wc -l /tmp/torch_mlp_trace.csv
fi
if [ -n "${SKIP_BENCH:-}" ]; then
  { echo "python tests:"; grep -E "PASSED|FAILED|SKIPPED|ERROR" "$OUT/pytest.log" | sed -E 's/^tests\/python\///; s/ +\[ *[0-9]+%\]//'; grep -E "^=+ .* in [0-9.]+s" "$OUT/pytest.log"; } > "$OUT/python-summary.txt"
  exit 0
fi
if [ -n "${WORKLOADS:-}" ]; then
  echo "== workload benchmark ($WORKLOADS), every allocator in this run"
  python3 bench/workloads/bench_workloads.py all --workloads "$WORKLOADS" --out "$OUT/workloads.jsonl" 2>&1 | tee "$OUT/workloads.log"
  { echo "workload benchmark:"; sed -n '/^### /,$p' "$OUT/workloads.log"; } > "$OUT/python-summary.txt"
  exit 0
fi
echo "== framework benchmark (churn.py), every allocator in this run"
gcc -O2 -shared -fPIC -I/usr/local/cuda/include bench/frameworks/passthrough.c -L/usr/local/cuda/lib64 -lcudart -o /tmp/passthrough.so
gcc -O2 -shared -fPIC -I/usr/local/cuda/include bench/gpu/churn_floor.c -L/usr/local/cuda/lib64 -lcuda -o /tmp/churn_floor.so
ROUNDS=${ROUNDS:-4} python3 bench/frameworks/bench_frameworks.py bench/frameworks "$GPUPOOL_LIBRARY" /tmp/passthrough.so /tmp/churn_floor.so "$OUT/bench.jsonl" 2>&1 | tee "$OUT/bench.log"
echo "== does the driver's own pool give memory back? (bench/frameworks/driver_pool_trim.py)"
python3 bench/frameworks/driver_pool_trim.py "$GPUPOOL_LIBRARY" 2>&1 | tee "$OUT/driver_pool.log"
{
  if [ -f "$OUT/pytest.log" ]; then
    echo "python tests:"
    grep -E "PASSED|FAILED|SKIPPED|ERROR" "$OUT/pytest.log" | sed -E 's/^tests\/python\///' | sed -E 's/ +\[ *[0-9]+%\]//'
    grep -E "^=+ .* in [0-9.]+s" "$OUT/pytest.log"
    echo
  fi
  echo "framework benchmark (µs per alloc+free pair through each framework's plug-in interface):"
  grep -E "^\||rounds" "$OUT/bench.log"
  echo
  echo "driver pool (used / live after the churn loop, and after cuMemPoolTrimTo(0)):"
  cat "$OUT/driver_pool.log"
} > "$OUT/python-summary.txt"
