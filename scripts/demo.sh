#!/usr/bin/env bash
# Build libgpupool.so and the C quickstart, then run it. Without a GPU it runs on the host
# upstream and says so.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/ensure_tools.sh
ensure_cmake
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build --target quickstart -j2
./build/quickstart
