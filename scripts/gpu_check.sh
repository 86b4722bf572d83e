#!/usr/bin/env bash
# GPU proof, run ON the GPU machine (no Rust there): builds the C examples and GPU tests
# with CMake against a prebuilt dist/libgpupool.so, runs every GPU test and benchmark, and
# prints a summary table last. Usage (from the repo root): scripts/gpu_check.sh [OUTDIR]
# CTEST_EXCLUDE=regex / CTEST_ONLY=regex: pass -E / -R to ctest (to split the run over the
# device's 10-minute limit per command); SKIP_BENCH=1: tests only.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-${OUT:-/tmp/gpupool-out}}
mkdir -p "$OUT"
LIB="$ROOT/dist/libgpupool.so"
cd "$ROOT"
if [ ! -f "$LIB" ]; then
  echo "error: $LIB is missing. This machine has no Rust toolchain: build the library where there is one" >&2
  echo "(cargo build --release && mkdir -p dist && cp target/release/libgpupool.so dist/) and bring dist/ along." >&2
  exit 1
fi
nvidia-smi -L
echo "== libgpupool.so dependencies (must not include libcuda)"; ldd "$LIB"

# RMM's C++ resources join threads_bench's table when its wheels were carried (.whl/).
RMM_ARGS=()
if ls .whl/librmm*.whl .whl/rapids_logger*.whl >/dev/null 2>&1; then
  rm -rf /tmp/gpupool-rmm && mkdir -p /tmp/gpupool-rmm
  for w in .whl/librmm*.whl .whl/rapids_logger*.whl; do python3 -m zipfile -e "$w" /tmp/gpupool-rmm; done
  RMM_ARGS=(-DGPUPOOL_RMM_ROOT=/tmp/gpupool-rmm/librmm -DGPUPOOL_RAPIDS_LOGGER_ROOT=/tmp/gpupool-rmm/rapids_logger)
fi
echo "== CMake build (examples + GPU tests)"
cmake -S . -B build-gpu -DGPUPOOL_LIBRARY="$LIB" -DCMAKE_BUILD_TYPE=Release "${RMM_ARGS[@]}" > /tmp/cmake.log 2>&1 \
  && cmake --build build-gpu -j16 >> /tmp/cmake.log 2>&1
build_rc=$?
tail -5 /tmp/cmake.log

echo "== ctest (every C test, example and GPU test)"
ctest --test-dir build-gpu --output-on-failure --timeout 300 ${CTEST_EXCLUDE:+-E "$CTEST_EXCLUDE"} ${CTEST_ONLY:+-R "$CTEST_ONLY"} 2>&1 | tee "$OUT/ctest.log"
cp build-gpu/Testing/Temporary/LastTest.log "$OUT/ctest-full.log" 2>/dev/null

echo "== hot-path microbenchmark (no framework)"
./build-gpu/hotpath_bench 2>&1 | tee "$OUT/hotpath.log"
echo "== threads and streams: gpupool vs cudaMallocAsync (and RMM's resources, with its wheels) from C (bench/gpu/threads_bench.c)"
[ -n "${SKIP_BENCH:-}" ] || ./build-gpu/threads_bench "${THREADS_BENCH_PAIRS:-20000}" 2>&1 | tee "$OUT/threads_bench.log"
# The same workloads on the host upstream, no driver: the library's own scaling on this
# machine's cores (built with Rust elsewhere: cargo build --release --example threads_host,
# copied to dist/).
if [ -z "${SKIP_BENCH:-}" ] && [ -x dist/threads_host ]; then
  echo "== the same workloads over the host upstream (bench/diagnostics/threads_host.rs): the library alone"
  dist/threads_host "${THREADS_BENCH_PAIRS:-20000}" 2>&1 | tee "$OUT/threads_host.log"
fi
echo "== driver call costs behind the upstreams (no gpupool)"
./build-gpu/driver_costs 2>&1 | tee -a "$OUT/hotpath.log"

if [ -x "$ROOT/scripts/gpu_python.sh" ]; then
  "$ROOT/scripts/gpu_python.sh" "$OUT"
fi

echo
echo "==================== SUMMARY ===================="
echo "build: $([ $build_rc -eq 0 ] && echo OK || echo FAILED)"
echo "| test | result | seconds |"
echo "|---|---|---|"
grep -E "^ *[0-9]+/[0-9]+ Test +#" "$OUT/ctest.log" | sed -E 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: ([^ ]+) \.+ *(\*\*\*)?([A-Za-z ]+[A-Za-z]) +([0-9.]+) sec/| \1 | \3 | \4 |/'
grep -E "tests passed" "$OUT/ctest.log"
echo
echo "key lines:"
grep -hE "^stream_stress pool=|^limit fill|^device fill|^reclaim released|^conformance .*passed|^cross-stream reuse|^record_stream|threads x|^pinned \(" "$OUT/ctest-full.log" | sort -u
[ -f "$OUT/hotpath.log" ] && cat "$OUT/hotpath.log"
[ -f "$OUT/threads_bench.log" ] && cat "$OUT/threads_bench.log"
[ -f "$OUT/threads_host.log" ] && cat "$OUT/threads_host.log"
[ -f "$OUT/python-summary.txt" ] && cat "$OUT/python-summary.txt"
# Fail when anything failed: the build, a ctest test, or a Python test.
failed=0
[ $build_rc -eq 0 ] || failed=1
grep -q "100% tests passed" "$OUT/ctest.log" || failed=1
if [ -f "$OUT/pytest.log" ] && grep -qE "^(FAILED|ERROR)|[0-9]+ (failed|error)" "$OUT/pytest.log"; then failed=1; fi
[ $failed -eq 0 ] && echo "GPU CHECK: PASSED" || echo "GPU CHECK: FAILED"
exit $failed
