#!/usr/bin/env bash
# The GPU numbers of docs/performance.md in one go (an H200 here), every case beside its
# bare-NIXL baselines of the same command: small pushes, the 8B 4k-token request direct and
# staged, the 70B 32k-token request, and the staged copy kernels alone. TESTS="tests/..." runs
# those tests first. Results: $OUT/*.json, $OUT/all.txt, $OUT/logs.tgz (every node's event log).
# Usage: OUT=runs/gpu bash bench/gpu_suite.sh
set -u
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; $PY -c "import torch; print(torch.__version__)"; } | tee -a "$OUT/all.txt"
if [ -n "${TESTS:-}" ]; then
  timeout 400 $PY -m pytest -q -p no:cacheprovider -o addopts="" $TESTS > "$OUT/tests.log" 2>&1
  echo "tests rc=$?" | tee -a "$OUT/all.txt"; tail -n 3 "$OUT/tests.log"; cat "$OUT/tests.log" >> "$OUT/all.txt"; rm -f "$OUT/tests.log"
fi
run() {
  local name=$1; shift
  echo "== $name: $*" | tee -a "$OUT/all.txt"
  timeout "${LIMIT:-300}" $PY -m pushactors bench "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "rc=$?"; grep -v '^.bench \|…' "$OUT/$name.log" | tail -n 16; cat "$OUT/$name.log" >> "$OUT/all.txt"; rm -f "$OUT/$name.log"
}
STAGING="--config staging_bytes=2147483648"
run small small --device cuda --count 100
run big_direct big --device cuda --layouts hnd,blhnc --patterns contiguous,fragmented,scattered --reps 3 --bare-poll 0
run big_staged big --device cuda --layouts hnd,blhnc --patterns scattered,fragmented --reps 3 --bare-poll 0 $STAGING
run big70 big --device cuda --shape 70b --layouts hnd,blhnc --patterns contiguous,scattered --reps 2 --bare-poll 0
run big70_staged big --device cuda --shape 70b --layouts hnd --patterns scattered --reps 2 --bare-poll 0 --config staging_bytes=12884901888
echo "== nixl_threads" | tee -a "$OUT/all.txt"
timeout 120 $PY bench/nixl_threads.py --device cuda 2>&1 | grep -v INFO | tee -a "$OUT/all.txt"
echo "== copy_rows" | tee -a "$OUT/all.txt"
timeout 200 $PY bench/copy_rows_bench.py --json "$OUT/copy_rows.json" >> "$OUT/all.txt" 2>&1; echo "rc=$?"
tar czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls -d *-logs) 2>/dev/null
ls -la "$OUT"
