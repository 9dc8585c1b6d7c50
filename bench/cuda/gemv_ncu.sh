#!/usr/bin/env bash
# On the device machine: an ncu source-level profile of the 1-row decode GEMV as the step runs it (synthetic
# Flash-Next, 4 layers): by default the 4th-6th launches of gemv_quant_kernel<4, 1>, which should be a GDN layer's
# grouped input products, out and router/shared-gate products; the grid sizes in details.txt say which is which (130,
# 80 and 33 blocks). Writes OUTDIR/gemv.ncu-rep, OUTDIR/details.txt (every section: warp states, memory, launch) and
# OUTDIR/source.csv (per SASS instruction: issue and stall samples by reason; builds without -lineinfo have no CUDA
# source lines).
# Usage: bench/cuda/gemv_ncu.sh OUTDIR VAVILOV_BINARY [SKIP COUNT]   (~20 s; ncu flushes caches before each replay)
# The filter is the mangled name: the demangled one is written gemv_quant_kernel<(int)4, (int)1>.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?OUTDIR}
binary=${2:?VAVILOV_BINARY}
skip=${3:-3}
count=${4:-3}
mkdir -p "$out"
ncu --set full --import-source yes --clock-control none --kernel-name-base mangled -k regex:gemv_quant_kernelILi4ELi1E \
  --launch-skip "$skip" --launch-count "$count" -f -o "$out/gemv" \
  "$binary" bench --synthetic models/configs/flash-next.json --layers 4 --steps 1 --prefill 8 > "$out/run.txt" 2>&1
ncu -i "$out/gemv.ncu-rep" --page details > "$out/details.txt"
ncu -i "$out/gemv.ncu-rep" --page source --csv --print-source sass > "$out/source.csv" ||
  ncu -i "$out/gemv.ncu-rep" --page source --csv > "$out/source.csv"  # an ncu without --print-source
grep -E "Grid Size|Duration|No Instruction|Stall|Issue Slots Busy|Memory Throughput" "$out/details.txt" | head -60
