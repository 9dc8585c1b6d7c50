#!/usr/bin/env bash
# On the device machine, in one call, building nothing: checks GDN prefill changes against a base build in the TF32
# product precisions (3×TF32, the default, and one-pass TF32, VAVILOV_GEMM_PRECISION=tf32) and times NEW's bf16 mode
# (VAVILOV_GEMM_PRECISION=bf16) beside them. In order, so that the measurements come back even if a sanitizer runs
# long:
#   1. NEW/vavilov_gpu_tests --gtest_filter='CudaGdn.*' (the prefill tests run every product mode and both prepare
#      blockings themselves)
#   2. bit identity: SAME/vavilov_gdn_bench check (a build whose change keeps every operation and its order) against
#      BASE on the same random inputs (T = 1000, 16 chunks, the release shape), SAME's prepare blocks left to its rule
#      and forced to one value head and to a key head a block (GDN_BENCH_PREPARE); byte for byte
#   3. vavilov_gdn_bench prefill (T = 64 … 8192, each a median of 20 calls) of BASE and NEW interleaved twice, then
#      each build of OTHER once, in both TF32 precisions; then SAME with its prepare blocks forced either way (the
#      rule's measurement); then NEW's bf16 mode twice (BASE, older than the mode, would run one-pass TF32 there)
#   4. where ncu is installed: NEW's three prefill kernels at T = 8192 (the first such call of `gdn_bench profile`),
#      all three modes (time, warp instructions, tensor pipe, DRAM bytes read and written)
#   5. compute-sanitizer memcheck over NEW's CudaGdn.ChunkedPrefill*:CudaGdn.PrefillPrepareBlocks* (at most
#      MEMCHECK_S seconds, default 25; 0 skips it)
# and prints one summary (also OUTDIR/summary.txt). Files under OUTDIR: summary.txt, tests.txt, identity.txt,
# bench.txt, ncu.txt, sanitizer.txt. A build is a folder with vavilov_gdn_bench (NEW also vavilov_gpu_tests); a lib/
# folder beside the builds (in their parent) goes on LD_LIBRARY_PATH. Needs python3 (standard library only).
# Usage: gdn_prefill_check.sh OUTDIR NEW BASE SAME [OTHER…]   (~90 s)
set -uo pipefail
out=${1:?OUTDIR}
new=${2:?NEW}
base=${3:?BASE}
same=${4:?SAME}
shift 4
others=("$@")
memcheck_s=${MEMCHECK_S:-25}
mkdir -p "$out"
lib="$(cd "$new/.." && pwd)/lib"
[ -d "$lib" ] && export LD_LIBRARY_PATH="$lib:${LD_LIBRARY_PATH:-}"
export VAVILOV_SOURCE_DIR=${VAVILOV_SOURCE_DIR:-$PWD}
summary="$out/summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }
# with_precision PRECISION COMMAND…: COMMAND with VAVILOV_GEMM_PRECISION=tf32 or bf16 (those) or without it (3xtf32).
with_precision() {
  local precision=$1
  shift
  if [ "$precision" = 3xtf32 ]; then env -u VAVILOV_GEMM_PRECISION "$@"; else VAVILOV_GEMM_PRECISION=$precision "$@"; fi
}
start=$SECONDS

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$summary"

# 1. Tests.
"$new/vavilov_gpu_tests" --gtest_filter='CudaGdn.*' > "$out/tests.txt" 2>&1
note "tests CudaGdn.*: exit $? ($(grep -E '^\[  (PASSED|FAILED)' "$out/tests.txt" | tr '\n' ' '))"
grep -E '^\[  FAILED|Failure|one-pass TF32 prefill|bf16 prefill' "$out/tests.txt" | head -80 | tee -a "$summary"

# 2. Bit identity of SAME with BASE on the same inputs.
work=$(mktemp -d)
python3 - "$work/in" 1000 << 'EOF'
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
  for run in base same:auto same:value same:key; do
    build=$base
    prepare=
    if [ "$run" != base ]; then
      build=$same
      prepare=${run#same:}
    fi
    [ "$prepare" = auto ] && prepare=
    GDN_BENCH_PREPARE=$prepare with_precision $precision "$build/vavilov_gdn_bench" check "$work/in" 1000 \
      >> "$out/identity.txt" 2>&1 || note "check $run $precision: FAILED"
    mv "$work/in/ours_out.f32" "$work/$run-$precision-out.f32" 2> /dev/null
    mv "$work/in/ours_state.f32" "$work/$run-$precision-state.f32" 2> /dev/null
  done
  for run in same:auto same:value same:key; do
    for part in out state; do
      if cmp "$work/base-$precision-$part.f32" "$work/$run-$precision-$part.f32" >> "$out/identity.txt" 2>&1; then
        note "identity $precision $run $part: the same as base byte for byte"
      else
        note "identity $precision $run $part: DIFFERENT (see identity.txt)"
      fi
    done
  done
done
cmp -s "$work/base-3xtf32-out.f32" "$work/base-tf32-out.f32" && note "identity: the two precisions gave the same outputs (the knob did not reach the prefill?)"

# 3. Interleaved timings (label=build[:prepare]).
: > "$out/bench.txt"
time_run() {  # PRECISION LABEL BUILD PREPARE
  echo "== $1 $2" >> "$out/bench.txt"
  GDN_BENCH_PREPARE=$4 with_precision "$1" "$3/vavilov_gdn_bench" prefill "$work/$1-$2.json" >> "$out/bench.txt" 2>&1 ||
    note "bench $1 $2: FAILED"
}
for precision in 3xtf32 tf32; do
  for round in 1 2; do
    time_run $precision base "$base" ""
    time_run $precision new "$new" ""
  done
  for other in "${others[@]}"; do time_run $precision "$(basename "$other")" "$other" ""; done
  time_run $precision same-value "$same" value
  time_run $precision same-key "$same" key
done
for round in 1 2; do time_run bf16 new "$new" ""; done
note "prefill (us, median of 20 calls; each run of a label):"
awk '/^== / {p = $2; label = $3; if (!((p, label) in seen)) {seen[p, label] = 1; order[p] = order[p] " " label}}
     /^prefill T/ {t = $3 + 0; v = $4 + 0; runs[p, label, t] = runs[p, label, t] " " v; ts[t] = 1; ps[p] = 1}
     END {for (p in ps) for (t in ts) {line = sprintf("  %-6s T %5d", p, t); n = split(order[p], labels, " ");
            for (i = 1; i <= n; ++i) line = line "  " labels[i] runs[p, labels[i], t]; print line}}' \
  "$out/bench.txt" | sort -k1,1 -k3n | tee -a "$summary"

# 4. ncu: the first T = 8192 call's three kernels (the profile runs T = 512 twice first: 6 launches skipped).
: > "$out/ncu.txt"
if command -v ncu > /dev/null; then
  for precision in 3xtf32 tf32 bf16; do
    echo "== $precision new" >> "$out/ncu.txt"
    with_precision $precision ncu --clock-control none --csv --print-units base -k regex:gdn_chunk --launch-skip 6 \
      --launch-count 3 --metrics gpu__time_duration.sum,smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum,dram__bytes_write.sum \
      "$new/vavilov_gdn_bench" profile >> "$out/ncu.txt" 2>&1 || note "ncu $precision: FAILED"
  done
  note "ncu at T = 8192 (ns, warp instructions, tensor pipe %, DRAM bytes read / written):"
  awk -F'","' '/^== / {split($0, w, " "); which = w[2] " " w[3]} /gdn_chunk/ {match($0, /gdn_chunk_[a-z0-9_]+/);
         k = substr($0, RSTART, RLENGTH); id = $1; gsub(/"/, "", id); v = $NF; gsub(/"/, "", v);
         m = $(NF - 2); m = m ~ /duration/ ? "ns" : m ~ /inst/ ? "inst" : m ~ /tensor/ ? "tensor%" : m ~ /read/ ? "rd" : "wr";
         key = which " " id " " k; if (!(key in line)) order[++count] = key; line[key] = line[key] " " m "=" v}
       END {for (i = 1; i <= count; ++i) print "  " order[i] line[order[i]]}' "$out/ncu.txt" | tee -a "$summary"
else
  note "ncu: not installed, skipped"
fi
rm -rf "$work"

# 5. memcheck, last and time-limited.
: > "$out/sanitizer.txt"
if [ "$memcheck_s" -gt 0 ]; then
  timeout "$memcheck_s" compute-sanitizer --tool memcheck --error-exitcode 1 "$new/vavilov_gpu_tests" \
    --gtest_filter='CudaGdn.ChunkedPrefill*:CudaGdn.PrefillPrepareBlocks*' >> "$out/sanitizer.txt" 2>&1
  rc=$?
  if [ $rc -eq 124 ]; then
    note "memcheck: stopped after $memcheck_s s (not a result; $(grep -c '^\[       OK' "$out/sanitizer.txt") tests passed under it, $(grep -c '^========= Invalid' "$out/sanitizer.txt") errors so far)"
  else
    note "memcheck: exit $rc ($(grep -E 'ERROR SUMMARY' "$out/sanitizer.txt" | tail -1))"
  fi
fi
note "total $((SECONDS - start)) s"
