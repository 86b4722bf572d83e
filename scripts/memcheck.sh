#!/usr/bin/env bash
# Memory checkers over everything that runs without a GPU (called by scripts/test.sh):
#  1. valgrind memcheck on every host C test (ctest -T memcheck): 0 errors, 0 bytes
#     definitely lost, or the test fails;
#  2. valgrind memcheck on the Rust integration tests that drive the pool on the host
#     upstream (the C API, conformance, streams, private pools, fault injection, thread caches,
#     destroyed streams);
#  3. the C tests built with AddressSanitizer and UndefinedBehaviorSanitizer (the Rust
#     library itself allocates through the same malloc, which ASan intercepts).
# What is NOT counted as an error, and why: "possibly lost" and "still reachable" blocks.
# The pools are process-lifetime statics (one per device, as the CUDA contexts they serve),
# so their tables are still held at exit; valgrind calls interior pointers into them
# "possibly lost". A fork child's copy of the parent's other threads' data is ignored too
# (--child-silent-after-fork): those threads do not exist in the child.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/ensure_tools.sh
ensure_cmake
ensure_valgrind
VG_OPTS="--leak-check=full --errors-for-leak-kinds=definite --error-exitcode=99 --child-silent-after-fork=yes"

echo "== valgrind: host C tests"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j2 >/dev/null
ctest --test-dir build -LE gpu -T memcheck \
  --overwrite MemoryCheckCommand="$(command -v valgrind)" \
  --overwrite MemoryCheckCommandOptions="$VG_OPTS" --output-on-failure 2>&1 | tail -25
# ctest's exit status reflects the tests, which fail on any valgrind error (--error-exitcode).
echo "note: ctest's \"Defects: N\" and \"Potential Memory Leak - N\" count valgrind's possibly-lost blocks: the pools' own tables,"
echo "  held by process-lifetime statics until exit. Not errors: a test fails on any valgrind error or a definitely lost byte."

echo "== valgrind: Rust tests on the host upstream"
bins=$(cargo test --release --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
want = {"ffi", "conformance", "streams", "streams_arena", "graph_pools", "faults", "faults_targeted", "thread_cache",
        "destroyed_streams"}
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in want:
        print(m["target"]["name"] + "=" + m["executable"])
')
[ "$(echo "$bins" | wc -w)" -eq 9 ] || { echo "error: expected 9 test binaries, found: $bins" >&2; exit 1; }
for pair in $bins; do
  name=${pair%%=*}; bin=${pair#*=}
  # Fewer fault-injection operations under valgrind (it runs ~30x slower). Each arena shard
  # reserves 5x its device's memory of address space (16 GiB simulated host devices by
  # default), more than valgrind's address space holds once several arena devices and
  # shards of a test binary are alive: 4 GiB ranges here (GPUPOOL_ARENA_VA) keep them real.
  if GPUPOOL_FAULT_OPS=2000 GPUPOOL_ARENA_VA=4GiB valgrind -q $VG_OPTS "$bin" --test-threads=2 > "build/valgrind-$name.log" 2>&1; then
    echo "valgrind $name: $(grep -h 'test result' "build/valgrind-$name.log")"
  else
    echo "valgrind $name FAILED:"; tail -60 "build/valgrind-$name.log"; exit 1
  fi
done

echo "== AddressSanitizer + UndefinedBehaviorSanitizer: host C tests"
SAN="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all"
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_FLAGS="$SAN" -DCMAKE_CXX_FLAGS="$SAN" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
cmake --build build-asan -j2 >/dev/null
# detect_leaks=0: LeakSanitizer cannot run under ptrace-restricted containers and the
# process-lifetime pools are reported by valgrind above; everything else ASan checks.
ASAN_OPTIONS=detect_leaks=0:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir build-asan -LE gpu --output-on-failure 2>&1 | tail -8
echo "== memory checkers: 0 errors"
