#!/usr/bin/env bash
# On the device machine, in one call, building nothing (~50 s): checks a build's quantized prefill products and times
# the prefill against a base binary.
#   1. BUILD/vavilov_gpu_tests --gtest_filter='CudaQuantGemm*', then the same under compute-sanitizer memcheck
#   2. BUILD/vavilov_gpu_tests over the model, linear and MoE suites (prefill through the products)
#   3. BUILD/vavilov_quant_gemm_bench at 512 rows (warp against block tiles at Flash-Next's shapes; exits non-zero
#      when the two cuts' bits differ)
#   4. the synthetic Flash-Next prefill at 512 and 2048 of BASE_VAVILOV and BUILD/vavilov: 8 layers interleaved
#      (base, new, base, new), then 48 layers + MTP once each
# Results go to OUTDIR/quant_gemm_check.tgz (one archive: the device tool brings back at most eight files); the
# summary is printed. A lib/ folder in BUILD goes on LD_LIBRARY_PATH (the shared libraries the device lacks). Run from
# the repository root (models/configs/flash-next.json; VAVILOV_SOURCE_DIR for the test fixtures).
# Usage: quant_gemm_check.sh OUTDIR BUILD BASE_VAVILOV
set -uo pipefail
out=${1:?OUTDIR}
build=${2:?BUILD}
base=${3:?BASE_VAVILOV}
export LD_LIBRARY_PATH=$PWD/$build/lib:${LD_LIBRARY_PATH:-} VAVILOV_SOURCE_DIR=${VAVILOV_SOURCE_DIR:-$PWD}
work=$(mktemp -d)
start=$(date +%s)
log() { echo "[$(($(date +%s) - start)) s] $*" | tee -a "$work/summary.txt"; }
pack() { tar czf "$out/quant_gemm_check.tgz" -C "$work" .; }

timeout 25 "$build/vavilov_gpu_tests" --gtest_filter='CudaQuantGemm*' > "$work/tests.txt" 2>&1
log "CudaQuantGemm* rc=$? $(grep -E 'PASSED|FAILED' "$work/tests.txt" | tr '\n' ' ')"
timeout 25 compute-sanitizer --tool memcheck "$build/vavilov_gpu_tests" --gtest_filter='CudaQuantGemm*' \
  > "$work/memcheck.txt" 2>&1
log "memcheck rc=$? $(grep 'ERROR SUMMARY' "$work/memcheck.txt")"
timeout 20 "$build/vavilov_gpu_tests" --gtest_filter='*GpuModel*:CudaLinear*:*CudaMoe*' > "$work/model-tests.txt" 2>&1
log "model/linear/moe rc=$? $(grep -E 'tests from.*ran|PASSED|FAILED' "$work/model-tests.txt" | tr '\n' ' ')"
timeout 15 "$build/vavilov_quant_gemm_bench" "$work/products.json" 512 > "$work/products.txt" 2>&1
log "products rc=$?"
cat "$work/products.txt" | tee -a "$work/summary.txt"
pack
prefill() {  # prefill LABEL BINARY LAYERS_ARGS...
  local label=$1 binary=$2
  shift 2
  timeout 30 "$binary" bench --synthetic models/configs/flash-next.json --prefill 512,2048 "$@" \
    --out "$work/bench-$label.json" > /dev/null 2>&1
  log "$label rc=$? prefill tok/s $(python3 -c "import json; print(json.load(open('$work/bench-$label.json'))['prefill_tok_s'])" 2>&1)"
}
prefill base8a "$base" --layers 8 --steps 2
prefill new8a "$build/vavilov" --layers 8 --steps 2
prefill base8b "$base" --layers 8 --steps 2
prefill new8b "$build/vavilov" --layers 8 --steps 2
prefill base48 "$base" --steps 1
prefill new48 "$build/vavilov" --steps 1
pack
