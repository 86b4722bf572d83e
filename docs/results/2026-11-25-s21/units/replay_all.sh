#!/bin/bash
# Replays the four s19 H100 traces (decompressed into /tmp/tr/ from docs/results/2026-11-25-s19/a/*.csv.xz) through the arena;
# prints peak mapped / peak in use (from the replay table, GiB to two decimals) and driver calls (all / second half).
# EXTRA=--no-arena-lend to pass a replay option; arguments are environment settings (VAR=value).
for t in tokens training churn serving; do
  env "$@" /work/main/target/release/gpupool-replay /tmp/tr/$t.csv --pool arena $EXTRA 2>&1 | grep '^| arena' | awk -F'|' -v t=$t '{split($3,a," "); split($4,b," "); ma=(a[2]=="GiB"?1024:1)*a[1]; mb=(b[2]=="GiB"?1024:1)*b[1]; printf "%-9s ratio %.3f  calls %s  ns/op %s\n", t, ma/mb, $11, $12}'
done
