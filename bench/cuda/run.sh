#!/usr/bin/env bash
# On the device machine (nvcc, no Debian libraries): builds the GPU benchmark with nvcc alone and runs it.
# Usage: bench/cuda/run.sh OUTDIR [VARIANT...]
#   VARIANT sets src/cuda/gemv.cu's tuning knob: u<groups per load batch>, e.g. u8; "default" (or none) builds the
#   default. Variants build in parallel and run in turn, each writing
#   OUTDIR/gemv-VARIANT.json and OUTDIR/ptxas-VARIANT.log.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-build/gpu}
shift || true
variants=("$@")
[ ${#variants[@]} -eq 0 ] && variants=(default)
mkdir -p "$out"
label=${GEMV_LABEL:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}  # GEMV_LABEL: where no .git travels
for v in "${variants[@]}"; do
  flags=()
  [[ $v =~ u([0-9]+) ]] && flags+=(-DVAVILOV_GEMV_UNROLL="${BASH_REMATCH[1]}")
  nvcc -O3 -std=c++17 -arch=sm_90 -Xptxas -v -Isrc "${flags[@]}" bench/cuda/gemv_bench.cu src/cuda/gemv.cu src/cuda/linear.cu \
    -o "$out/gemv_bench-$v" 2> "$out/ptxas-$v.log" &
done
wait
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
for v in "${variants[@]}"; do
  grep -E "registers|spill" "$out/ptxas-$v.log" | sort | uniq -c | head -20
  "$out/gemv_bench-$v" "$out/gemv-$v.json" "$label $v" || echo "variant $v: FAILED"
done
