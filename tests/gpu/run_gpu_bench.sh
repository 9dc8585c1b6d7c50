#!/usr/bin/env bash
# On the GPU machine, from the repository root: the GPU tests, then `vavilov bench` at the real Flash-Next geometry
# (synthetic Q4 weights, all 48 layers and the MTP head), its JSON written under OUT_DIR (default bench/results), once
# with the decode passes as CUDA graphs and once with the same launches eager (VAVILOV_CUDA_GRAPH=0, `-eager.json`).
#   tests/gpu/run_gpu_bench.sh [BUILD_DIR] [OUT_DIR] [COMMIT]
set -euo pipefail
build=${1:-build}
out=${2:-bench/results}
commit=${3:-$(git rev-parse --short HEAD 2> /dev/null || echo unknown)}
tests/gpu/run_gpu_tests.sh "$build"
mkdir -p "$out"
name="$out/$(date -u +%F)-h200-cuda-decode-flash-next-q4"
"$build/vavilov" bench --synthetic models/configs/flash-next.json --commit "$commit" --out "$name.json"
VAVILOV_CUDA_GRAPH=0 "$build/vavilov" bench --synthetic models/configs/flash-next.json --commit "$commit" \
  --out "$name-eager.json"
