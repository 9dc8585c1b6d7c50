#!/usr/bin/env bash
# On the device machine (nvcc, no Debian libraries): builds the GPU benchmarks with nvcc alone and runs them.
# Usage: bench/cuda/run.sh OUTDIR
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-build/gpu}
mkdir -p "$out"
nvcc -O3 -std=c++17 -arch=sm_90 -Xptxas -v -Isrc bench/cuda/gemv_bench.cu src/cuda/gemv.cu -o "$out/gemv_bench" \
  2> "$out/ptxas.log"
grep -E "registers|spill" "$out/ptxas.log" | sort | uniq -c | head -20
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
"$out/gemv_bench" "$out/gemv.json"
