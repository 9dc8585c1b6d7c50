#!/usr/bin/env bash
# On the device machine, in one call, building nothing (~110 s): checks a build's quantized prefill products (the
# routed experts' split rows, quant_gemm.cuh) and times them and the prefill against a base binary. Each step has its
# own time limit and the summary is written as it goes, so that a call cut short still brings back what it finished.
#   1. BUILD/vavilov_gpu_tests --gtest_filter='CudaQuantGemm*', the same under compute-sanitizer memcheck, then the
#      model, linear, MoE and expert suites (prefill through the products)
#   2. BUILD/vavilov_quant_gemm_bench at 512 rows (dense shapes, then the routed experts' split and products; exits
#      non-zero when bits differ), and every BUILD/vavilov_quant_gemm_bench.NAME (a tuning variant) the same way
#   3. the synthetic Flash-Next prefill at 512 and 2048 of BASE_VAVILOV, BUILD/vavilov and every BUILD/vavilov.NAME:
#      8 layers twice, interleaved, then 48 layers + MTP once each
#   4. ncu's per-kernel time of the 4-layer prefill at 512 (NVTX range prefill512) of BUILD/vavilov and each variant
#   5. each variant's tests as in 1 where BUILD/vavilov_gpu_tests.NAME exists
# Results: OUTDIR/summary.txt and OUTDIR/expert_products_check.tgz. A lib/ folder in BUILD goes on LD_LIBRARY_PATH.
# Run from the repository root (models/configs/flash-next.json; VAVILOV_SOURCE_DIR for the test fixtures).
# Usage: expert_products_check.sh OUTDIR BUILD BASE_VAVILOV
set -uo pipefail
out=${1:?OUTDIR}
build=${2:?BUILD}
base=${3:?BASE_VAVILOV}
export LD_LIBRARY_PATH=$PWD/$build/lib:${LD_LIBRARY_PATH:-} VAVILOV_SOURCE_DIR=${VAVILOV_SOURCE_DIR:-$PWD}
config=models/configs/flash-next.json
work=$(mktemp -d)
start=$(date +%s)
log() { echo "[$(($(date +%s) - start)) s] $*" | tee -a "$out/summary.txt"; }
pack() { tar czf "$out/expert_products_check.tgz" -C "$work" .; }
variants=$(cd "$build" && ls vavilov.* 2> /dev/null | sed 's/^vavilov\.//')

tests() {  # tests LABEL BINARY [model]
  timeout 25 "$2" --gtest_filter='CudaQuantGemm*' > "$work/tests-$1.txt" 2>&1
  log "$1 CudaQuantGemm* rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$work/tests-$1.txt" | tr '\n' ' ')"
  grep -E '^\[  FAILED|Failure|Expected|Which is|actual' "$work/tests-$1.txt" | head -20 >> "$out/summary.txt"
  timeout 40 compute-sanitizer --tool memcheck "$2" --gtest_filter='CudaQuantGemm*' > "$work/memcheck-$1.txt" 2>&1
  log "$1 memcheck rc=$? $(grep -E 'ERROR SUMMARY|^\[  (PASSED|FAILED)' "$work/memcheck-$1.txt" | tr '\n' ' ')"
  timeout 30 "$2" --gtest_filter='*GpuModel*:CudaLinear*:*CudaMoe*:CudaExpert*' > "$work/model-tests-$1.txt" 2>&1
  log "$1 model/linear/moe/expert rc=$? $(grep -E '^\[  (PASSED|FAILED|  SKIPPED) ' "$work/model-tests-$1.txt" |
    tr '\n' ' ')"
  grep -E '^\[  FAILED' "$work/model-tests-$1.txt" | head -10 >> "$out/summary.txt"
  pack
}
tests new "$build/vavilov_gpu_tests"
for bench in "$build"/vavilov_quant_gemm_bench "$build"/vavilov_quant_gemm_bench.*; do
  [ -x "$bench" ] || continue
  name=$(basename "$bench")
  timeout 25 "$bench" "$work/$name.json" 512 > "$work/$name.txt" 2>&1
  log "$name rc=$?"
  grep -E "expert|mix_down" "$work/$name.txt" | tee -a "$out/summary.txt"
done
pack
prefill() {  # prefill LABEL BINARY ARGS...
  local label=$1 binary=$2
  shift 2
  timeout 30 "$binary" bench --synthetic $config --prefill 512,2048 "$@" --out "$work/bench-$label.json" \
    > "$work/bench-$label.log" 2>&1
  log "$label rc=$? prefill tok/s $(python3 -c "import json; print(json.load(open('$work/bench-$label.json'))['prefill_tok_s'])" 2>&1)"
}
for round in a b; do
  prefill base8$round "$base" --layers 8 --steps 1
  prefill new8$round "$build/vavilov" --layers 8 --steps 1
  for v in $variants; do prefill $v-8$round "$build/vavilov.$v" --layers 8 --steps 1; done
done
pack
prefill base48 "$base" --steps 1
prefill new48 "$build/vavilov" --steps 1
for v in $variants; do prefill $v-48 "$build/vavilov.$v" --steps 1; done
pack
ncu_times() {  # name binary: per-kernel time of a 4-layer prefill at 512 (the NVTX range prefill512)
  timeout 40 ncu --clock-control none --cache-control none --nvtx --nvtx-include "prefill512/" \
    --metrics gpu__time_duration.sum --csv --page raw --log-file "$work/ncu_$1.csv" \
    "$2" bench --synthetic $config --layers 4 --steps 1 --prefill 512 --out "$work/ncu_bench_$1.json" > /dev/null 2>&1
  log "ncu $1 rc=$?"
  pack
}
ncu_times new "$build/vavilov"
for v in $variants; do ncu_times $v "$build/vavilov.$v"; done
for v in $variants; do [ -x "$build/vavilov_gpu_tests.$v" ] && tests $v "$build/vavilov_gpu_tests.$v"; done
# 6. with the time left (EXPERT_CHECK_LIMIT seconds in all, default 115): ncu's full source-level profile of
#    BUILD/vavilov's first two routed-expert launches (gate, up) of a 1-layer prefill at 512
left=$((${EXPERT_CHECK_LIMIT:-115} - ($(date +%s) - start)))
if [ $left -gt 12 ]; then
  timeout $left ncu --set full --import-source yes --nvtx --nvtx-include "prefill512/" -k regex:quant_expert_kernel \
    --launch-count 2 -o "$work/expert_profile" "$build/vavilov" bench --synthetic $config --layers 1 --steps 1 \
    --prefill 512 --out "$work/ncu_profile_bench.json" > "$work/expert_profile.log" 2>&1
  log "ncu profile rc=$?"
  ncu -i "$work/expert_profile.ncu-rep" --page details > "$work/expert_profile_details.txt" 2>&1
  ncu -i "$work/expert_profile.ncu-rep" --page source --csv > "$work/expert_profile_source.csv" 2>&1
  pack
fi
