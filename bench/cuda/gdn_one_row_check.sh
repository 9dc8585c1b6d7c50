#!/usr/bin/env bash
# Device check of the 1-row GDN decode body (session 8, branch s8-gdn1), one call, from the repository root:
#   bench/cuda/gdn_one_row_check.sh DIR [OUT]
# DIR holds vavilov, vavilov_gpu_tests, vavilov_gdn_bench (the branch), vavilov-base and vavilov_gdn_bench-base (main
# at the branch point) and lib/. Runs CudaGdn.* and *GpuModel*, memcheck over the GDN decode tests, a 12-layer
# synthetic A/B interleaved (base, new, base, new), gdn_bench time (new, base), then the new vavilov with
# VAVILOV_GDN_ONE_ROW=0 (the general body at 1 row, same binary).
# Each step has its own time limit so that a slow one leaves the rest their time; OUT gets every log and JSON.
set -uo pipefail
D=${1:?DIR} OUT=${2:-${OUT:-/tmp/gdn1}}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$PWD/$D/lib:${LD_LIBRARY_PATH:-} VAVILOV_SOURCE_DIR=$PWD
t0=$(date +%s)
el() { echo "[$(($(date +%s) - t0)) s] $*" | tee -a "$OUT/summary.txt"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/summary.txt"
for f in 'CudaGdn*' '*GpuModel*'; do
  timeout 22 "$D/vavilov_gpu_tests" --gtest_brief=1 --gtest_filter="$f" >> "$OUT/tests.txt" 2>&1
  el "tests $f rc=$?"
done
grep -E "FAILED|PASSED|tests from.*ran" "$OUT/tests.txt" | head -12 | tee -a "$OUT/summary.txt"
timeout 20 compute-sanitizer --tool memcheck --error-exitcode 3 --print-limit 20 "$D/vavilov_gpu_tests" --gtest_brief=1 \
  --gtest_filter='CudaGdn.*Decode*' > "$OUT/memcheck.txt" 2>&1
el "memcheck rc=$?"
grep -E "ERROR SUMMARY|FAILED|PASSED" "$OUT/memcheck.txt" | head -5 | tee -a "$OUT/summary.txt"
ab() {  # N NAME BINARY [ENV]
  env ${4:-} timeout 18 "$3" bench $S --out "$OUT/ab-$1-$2.json" > /dev/null 2>&1
  python3 -c "import json; print('ab $1 $2', {k: round(x, 4) for k, x in json.load(open('$OUT/ab-$1-$2.json'))['step_ms'].items()})" 2>&1 |
    tee -a "$OUT/summary.txt"
}
S="--synthetic models/configs/flash-next.json --layers 12 --steps 10 --prefill 64"
n=0
for v in base new base new; do
  n=$((n + 1))
  bin=$D/vavilov
  [ $v = base ] && bin=$D/vavilov-base
  ab "$n" "$v" "$bin"
done
el "ab done"
timeout 12 "$D/vavilov_gdn_bench" time "$OUT/gdn-new.json" > "$OUT/gdn-new.txt" 2>&1
el "gdn_bench new rc=$?"
grep -E "^conv_decode|^separate" "$OUT/gdn-new.txt" | tee -a "$OUT/summary.txt"
timeout 12 "$D/vavilov_gdn_bench-base" time "$OUT/gdn-base.json" > "$OUT/gdn-base.txt" 2>&1
el "gdn_bench base rc=$?"
grep -E "^conv_decode|^separate" "$OUT/gdn-base.txt" | tee -a "$OUT/summary.txt"
ab 5 general "$D/vavilov" VAVILOV_GDN_ONE_ROW=0
el "general done"
