#!/usr/bin/env bash
# The GPU numbers of docs/performance.md in one go (an H200 here): direct, staged and tuned
# pushes of the 8B 4k-token request beside bare NIXL, then small pushes. Results: $OUT/*.json
# and $OUT/*.txt. Usage: OUT=runs/gpu bash bench/gpu_suite.sh
set -u
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
run() { local name=$1; shift; echo "== $name: $*"; timeout "${LIMIT:-240}" $PY -m pushactors bench "$@" --json "$OUT/$name.json" > "$OUT/$name.txt" 2>&1; echo "rc=$?"; tail -n 14 "$OUT/$name.txt"; }
run big_direct big --device cuda --layouts hnd,blhnc --patterns contiguous,scattered --reps 3
run big_staged big --device cuda --layouts hnd --patterns scattered,fragmented --reps 3 --config staging_bytes=2147483648
run big_tuned big --device cuda --layouts hnd,blhnc --patterns scattered --reps 3 --config nixl_num_threads=4 --config nixl_sgl=true
run big_staged_tuned big --device cuda --layouts hnd --patterns scattered --reps 3 --config staging_bytes=2147483648 --config nixl_num_threads=4 --config nixl_sgl=true
run small small --device cuda --count 100
