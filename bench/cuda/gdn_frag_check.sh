#!/usr/bin/env bash
# On the device machine, in one call, building nothing: checks a build's GDN prefill and times it against a base build.
#   1. NEW_BUILD/vavilov_gpu_tests --gtest_filter='CudaGdn.*'
#   2. compute-sanitizer --tool memcheck over CudaGdn.ChunkedPrefill* (the chunked prefill's kernels at every test
#      shape), then --tool racecheck over CudaGdn.ChunkedPrefillMatchesRecurrence (shared-memory hazards between the
#      scan's barriers; at most RACECHECK_S seconds, default 150, 0 skips it)
#   3. vavilov_gdn_bench prefill of BASE_BUILD and NEW_BUILD interleaved (base, new, base, new; each a median of 20
#      calls at T = 64, 512, 2048, 8192)
#   4. where ncu is installed: the prefill kernels of both builds under ncu (time, instructions, tensor pipe)
# and prints one summary (also OUTDIR/summary.txt). Five files under OUTDIR: summary.txt, tests.txt, sanitizer.txt,
# bench.txt, ncu.txt (the device tool brings back at most eight).
# NEW_BUILD holds vavilov_gpu_tests and vavilov_gdn_bench, BASE_BUILD vavilov_gdn_bench; a lib/ folder in either goes
# on LD_LIBRARY_PATH (the shared libraries the device lacks). The script needs nothing else from the tree, so it may
# travel inside a carried build folder.
# Usage: gdn_frag_check.sh OUTDIR NEW_BUILD BASE_BUILD   (~3-4 minutes with racecheck)
set -uo pipefail
out=${1:?OUTDIR}
new=${2:?NEW_BUILD}
base=${3:?BASE_BUILD}
racecheck_s=${RACECHECK_S:-150}
mkdir -p "$out"
for dir in "$new" "$base"; do
  [ -d "$dir/lib" ] && export LD_LIBRARY_PATH="$(cd "$dir/lib" && pwd):${LD_LIBRARY_PATH:-}"
done
export VAVILOV_SOURCE_DIR=${VAVILOV_SOURCE_DIR:-$PWD}
summary="$out/summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$summary"

"$new/vavilov_gpu_tests" --gtest_filter='CudaGdn.*' > "$out/tests.txt" 2>&1
note "tests CudaGdn.*: exit $? ($(grep -E '^\[  (PASSED|FAILED)' "$out/tests.txt" | tr '\n' ' '))"
grep -E '^\[  FAILED|Failure|error_of|Expected' "$out/tests.txt" | head -20 | tee -a "$summary"

: > "$out/sanitizer.txt"
compute-sanitizer --tool memcheck --error-exitcode 1 "$new/vavilov_gpu_tests" \
  --gtest_filter='CudaGdn.ChunkedPrefill*' >> "$out/sanitizer.txt" 2>&1
note "memcheck CudaGdn.ChunkedPrefill*: exit $? ($(grep -E 'ERROR SUMMARY' "$out/sanitizer.txt" | tail -1))"
if [ "$racecheck_s" -gt 0 ]; then
  timeout "$racecheck_s" compute-sanitizer --tool racecheck --error-exitcode 1 "$new/vavilov_gpu_tests" \
    --gtest_filter='CudaGdn.ChunkedPrefillMatchesRecurrence' >> "$out/sanitizer.txt" 2>&1
  rc=$?
  [ $rc -eq 124 ] && note "racecheck: stopped after ${racecheck_s} s (not a result)" ||
    note "racecheck CudaGdn.ChunkedPrefillMatchesRecurrence: exit $rc ($(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$out/sanitizer.txt" | tail -1))"
fi

work=$(mktemp -d)
: > "$out/bench.txt"
for round in 1 2; do
  for which in base new; do
    dir=$base
    [ $which = new ] && dir=$new
    echo "== $which round $round" >> "$out/bench.txt"
    "$dir/vavilov_gdn_bench" prefill "$work/$which-$round.json" >> "$out/bench.txt" 2>&1 || note "bench $which: FAILED"
  done
done
# "prefill T 8192: 1901.1 us (...)" lines → per T: base runs, new runs, new/base of the means.
note "prefill (us, median of 20 calls; rounds 1 and 2):"
awk '/^== / {which = $2} /^prefill T/ {t = $3 + 0; v = $4 + 0; runs[which, t] = runs[which, t] " " v;
       sum[which, t] += v; n[which, t]++; ts[t] = 1}
     END {for (t in ts) printf "  T %5d  base%s  new%s  new/base %.3f\n", t, runs["base", t], runs["new", t],
            (sum["new", t] / n["new", t]) / (sum["base", t] / n["base", t])}' "$out/bench.txt" | sort -k2 -n |
  tee -a "$summary"

: > "$out/ncu.txt"
if command -v ncu > /dev/null; then
  for which in base new; do
    dir=$base
    [ $which = new ] && dir=$new
    echo "== $which" >> "$out/ncu.txt"
    ncu --clock-control none --csv --print-units base -k regex:gdn_chunk \
      --metrics gpu__time_duration.sum,smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
      "$dir/vavilov_gdn_bench" profile >> "$out/ncu.txt" 2>&1 || note "ncu $which: FAILED"
  done
  # One line a launch: build, kernel, then each metric's value (the profile runs T = 512, then 8192, twice each).
  note "ncu (launches in order: T = 512 twice, then 8192 twice):"
  awk -F'","' '/^== / {split($0, w, " "); which = w[2]} /gdn_chunk/ {match($0, /gdn_chunk_[a-z_]+/);
         k = substr($0, RSTART, RLENGTH); id = $1; gsub(/"/, "", id); v = $NF; gsub(/"/, "", v);
         m = $(NF - 2); m = m ~ /duration/ ? "ns" : m ~ /inst/ ? "inst" : "tensor%"; key = which " " id " " k;
         if (!(key in line)) order[++count] = key; line[key] = line[key] " " m "=" v}
       END {for (i = 1; i <= count; ++i) print "  " order[i] line[order[i]]}' "$out/ncu.txt" | tee -a "$summary"
else
  note "ncu: not installed, skipped"
fi
rm -rf "$work"
