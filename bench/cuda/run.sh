#!/usr/bin/env bash
# On the device machine: runs the GEMV benchmark of one or more builds (each built here with CMake and carried, with
# the shared libraries it needs on LD_LIBRARY_PATH) and records the kernels' register use.
# Usage: bench/cuda/run.sh OUTDIR BUILD_DIR...
#   A tuning variant is a build with the knob set, e.g.
#   cmake -S . -B build-u8 -G Ninja -DCMAKE_CUDA_FLAGS=-DVAVILOV_GEMV_UNROLL=8 && ninja -C build-u8 vavilov_gemv_bench
#   Each BUILD_DIR writes OUTDIR/gemv-<its name>.json.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?OUTDIR}
shift
[ $# -gt 0 ] || { echo "usage: bench/cuda/run.sh OUTDIR BUILD_DIR..." >&2; exit 2; }
mkdir -p "$out"
label=${GEMV_LABEL:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}  # GEMV_LABEL: where no .git travels
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
for build in "$@"; do
  name=$(basename "$build")
  cuobjdump --dump-resource-usage "$build/vavilov_gemv_bench" 2> /dev/null | grep -E "REG|STACK" | sort | uniq -c |
    head -20 || true
  "$build/vavilov_gemv_bench" "$out/gemv-$name.json" "$label $name" || echo "build $name: FAILED"
done
