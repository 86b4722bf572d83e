#!/usr/bin/env bash
# ThreadSanitizer over the Rust tests that run threads against the pool on the host
# upstream (the thread caches, cross-thread frees, thread exit, the C API from many threads).
# Needs a nightly toolchain with rust-src (std itself must be built instrumented, or every
# lock inside std would look like a race): `rustup component add rust-src --toolchain nightly`.
# Not part of scripts/test.sh: CI's machine has no nightly toolchain. Usage: scripts/tsan.sh
# [TEST ...] (default: thread_cache ffi destroyed_streams). Exit 0 only with no report.
set -euo pipefail
cd "$(dirname "$0")/.."
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=(thread_cache ffi destroyed_streams)
target=$(rustc -vV | sed -n 's/^host: //p')
args=()
for t in "${tests[@]}"; do args+=(--test "$t"); done
# halt_on_error: the first report fails the run; second_deadlock_stack for lock-order reports.
export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1"
RUSTFLAGS="-Zsanitizer=thread" CARGO_TARGET_DIR=build/tsan-target \
  cargo +nightly test -Zbuild-std --target "$target" --release "${args[@]}" -- --test-threads=4
