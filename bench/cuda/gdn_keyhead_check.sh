#!/usr/bin/env bash
# On the device machine, in one call, building nothing: checks the GDN prefill with its prepare kernel per key head
# (branch s9-gdnprep) against a base build, in both product precisions (3×TF32, the default, and one-pass TF32,
# VAVILOV_GEMM_PRECISION=tf32). In order, so that the measurements come back even if a sanitizer runs long:
#   1. NEW_BUILD/vavilov_gpu_tests --gtest_filter='CudaGdn.*' (the prefill tests run both precisions themselves)
#   2. bit identity: BASE and NEW `vavilov_gdn_bench check` on the same random inputs (T = 1000, 16 chunks, the
#      release shape) in both precisions; the outputs and final states must be byte for byte the same (the change
#      keeps every operation and its order)
#   3. vavilov_gdn_bench prefill of BASE and NEW interleaved (base, new, base, new) in both precisions (each a median
#      of 20 calls at T = 64, 512, 2048, 8192)
#   4. where ncu is installed: the three prefill kernels of the first T = 8192 call of `gdn_bench profile`, both
#      builds, both precisions (time, warp instructions, tensor pipe, DRAM bytes read and written)
#   5. compute-sanitizer memcheck over CudaGdn.ChunkedPrefill* (at most MEMCHECK_S seconds, default 50), then racecheck
#      over CudaGdn.ChunkedPrefillOfKeyHeadsWithManyValueHeadsMatchesRecurrence (the per-key-head loop and the
#      in-place inversion in both precisions; at most RACECHECK_S seconds, default 40; 0 skips either)
# and prints one summary (also OUTDIR/summary.txt). Files under OUTDIR: summary.txt, tests.txt, identity.txt,
# bench.txt, ncu.txt, sanitizer.txt (the device tool brings back at most eight).
# NEW_BUILD holds vavilov_gpu_tests and vavilov_gdn_bench, BASE_BUILD vavilov_gdn_bench; a lib/ folder in either goes
# on LD_LIBRARY_PATH (the shared libraries the device lacks). Needs python3 (standard library only) for the inputs.
# Usage: gdn_keyhead_check.sh OUTDIR NEW_BUILD BASE_BUILD   (~150 s with the default sanitizer limits)
set -uo pipefail
out=${1:?OUTDIR}
new=${2:?NEW_BUILD}
base=${3:?BASE_BUILD}
memcheck_s=${MEMCHECK_S:-50}
racecheck_s=${RACECHECK_S:-40}
mkdir -p "$out"
for dir in "$new" "$base"; do
  [ -d "$dir/lib" ] && export LD_LIBRARY_PATH="$(cd "$dir/lib" && pwd):${LD_LIBRARY_PATH:-}"
done
export VAVILOV_SOURCE_DIR=${VAVILOV_SOURCE_DIR:-$PWD}
summary="$out/summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }
build_of() { [ "$1" = new ] && echo "$new" || echo "$base"; }
# with_precision PRECISION COMMAND…: COMMAND with VAVILOV_GEMM_PRECISION=tf32 (tf32) or without it (3xtf32).
with_precision() {
  local precision=$1
  shift
  if [ "$precision" = tf32 ]; then VAVILOV_GEMM_PRECISION=tf32 "$@"; else env -u VAVILOV_GEMM_PRECISION "$@"; fi
}
start=$SECONDS

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$summary"

# 1. Tests.
"$new/vavilov_gpu_tests" --gtest_filter='CudaGdn.*' > "$out/tests.txt" 2>&1
note "tests CudaGdn.*: exit $? ($(grep -E '^\[  (PASSED|FAILED)' "$out/tests.txt" | tr '\n' ' '))"
grep -E '^\[  FAILED|Failure|one-pass TF32 prefill' "$out/tests.txt" | head -30 | tee -a "$summary"

# 2. Bit identity with the base build on the same inputs.
work=$(mktemp -d)
python3 - "$work/in" 1000 <<'EOF'
import array, os, random, sys
# Random inputs of `gdn_bench check` (layouts of GdnInputs at 48 value / 16 key heads, dk = dv = 128).
directory, rows = sys.argv[1], int(sys.argv[2])
os.makedirs(directory, exist_ok=True)
rng = random.Random(2026)
heads, dv, conv_dim = 48, 128, 2 * 16 * 128 + 48 * 128
def write(name, n, scale, offset=0.0):
    array.array("f", (offset + scale * (2.0 * rng.random() - 1.0) for _ in range(n))).tofile(open(f"{directory}/{name}.f32", "wb"))
write("qkv", rows * conv_dim, 1.0)
write("b", rows * heads, 2.0)
write("a", rows * heads, 2.0)
write("a_log", heads, 0.5)
write("dt_bias", heads, 1.0)
write("z", rows * heads * dv, 1.0)
write("norm", dv, 0.1, 1.0)
EOF
: > "$out/identity.txt"
for precision in 3xtf32 tf32; do
  for which in base new; do
    with_precision $precision "$(build_of $which)/vavilov_gdn_bench" check "$work/in" 1000 >> "$out/identity.txt" 2>&1 ||
      note "check $which $precision: FAILED"
    mv "$work/in/ours_out.f32" "$work/$which-$precision-out.f32" 2> /dev/null
    mv "$work/in/ours_state.f32" "$work/$which-$precision-state.f32" 2> /dev/null
  done
  for part in out state; do
    if cmp "$work/base-$precision-$part.f32" "$work/new-$precision-$part.f32" >> "$out/identity.txt" 2>&1; then
      note "identity $precision $part: base and new byte for byte the same"
    else
      note "identity $precision $part: DIFFERENT (see identity.txt)"
    fi
  done
done
cmp -s "$work/new-3xtf32-out.f32" "$work/new-tf32-out.f32" && note "identity: the two precisions gave the same outputs (the knob did not reach the prefill?)"

# 3. Interleaved timings.
: > "$out/bench.txt"
for precision in 3xtf32 tf32; do
  for round in 1 2; do
    for which in base new; do
      echo "== $precision $which round $round" >> "$out/bench.txt"
      with_precision $precision "$(build_of $which)/vavilov_gdn_bench" prefill "$work/$precision-$which-$round.json" \
        >> "$out/bench.txt" 2>&1 || note "bench $precision $which: FAILED"
    done
  done
done
# "prefill T 8192: 1901.1 us (...)" lines → per precision and T: base runs, new runs, new/base of the means.
note "prefill (us, median of 20 calls; rounds 1 and 2):"
awk '/^== / {p = $2; which = $3} /^prefill T/ {t = $3 + 0; v = $4 + 0; runs[p, which, t] = runs[p, which, t] " " v;
       sum[p, which, t] += v; n[p, which, t]++; ts[t] = 1; ps[p] = 1}
     END {for (p in ps) for (t in ts) if (n[p, "base", t] && n[p, "new", t]) printf "  %-6s T %5d  base%s  new%s  new/base %.3f\n", p, t, runs[p, "base", t],
            runs[p, "new", t], (sum[p, "new", t] / n[p, "new", t]) / (sum[p, "base", t] / n[p, "base", t])}' \
  "$out/bench.txt" | sort -k1,1 -k3n | tee -a "$summary"

# 4. ncu: the first T = 8192 call's three kernels (the profile runs T = 512 twice first: 6 launches skipped).
: > "$out/ncu.txt"
if command -v ncu > /dev/null; then
  for precision in 3xtf32 tf32; do
    for which in base new; do
      echo "== $precision $which" >> "$out/ncu.txt"
      with_precision $precision ncu --clock-control none --csv --print-units base -k regex:gdn_chunk --launch-skip 6 \
        --launch-count 3 --metrics gpu__time_duration.sum,smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum,dram__bytes_write.sum \
        "$(build_of $which)/vavilov_gdn_bench" profile >> "$out/ncu.txt" 2>&1 || note "ncu $precision $which: FAILED"
    done
  done
  note "ncu at T = 8192 (ns, warp instructions, tensor pipe %, DRAM bytes read / written):"
  awk -F'","' '/^== / {split($0, w, " "); which = w[2] " " w[3]} /gdn_chunk/ {match($0, /gdn_chunk_[a-z_]+/);
         k = substr($0, RSTART, RLENGTH); id = $1; gsub(/"/, "", id); v = $NF; gsub(/"/, "", v);
         m = $(NF - 2); m = m ~ /duration/ ? "ns" : m ~ /inst/ ? "inst" : m ~ /tensor/ ? "tensor%" : m ~ /read/ ? "rd" : "wr";
         key = which " " id " " k; if (!(key in line)) order[++count] = key; line[key] = line[key] " " m "=" v}
       END {for (i = 1; i <= count; ++i) print "  " order[i] line[order[i]]}' "$out/ncu.txt" | tee -a "$summary"
else
  note "ncu: not installed, skipped"
fi
rm -rf "$work"

# 5. Sanitizers, last and time-limited.
: > "$out/sanitizer.txt"
sanitize() {  # TOOL SECONDS FILTER
  [ "$2" -gt 0 ] || return 0
  timeout "$2" compute-sanitizer --tool "$1" --error-exitcode 1 "$new/vavilov_gpu_tests" --gtest_filter="$3" \
    >> "$out/sanitizer.txt" 2>&1
  local rc=$?
  if [ $rc -eq 124 ]; then
    note "$1 $3: stopped after $2 s (not a result)"
  else
    note "$1 $3: exit $rc ($(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$out/sanitizer.txt" | tail -1))"
  fi
}
sanitize memcheck "$memcheck_s" 'CudaGdn.ChunkedPrefill*'
sanitize racecheck "$racecheck_s" 'CudaGdn.ChunkedPrefillOfKeyHeadsWithManyValueHeadsMatchesRecurrence'
note "total $((SECONDS - start)) s"
