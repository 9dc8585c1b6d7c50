#!/usr/bin/env bash
# On the device machine: an ncu source-level profile of one decode kernel as the step runs it (synthetic Flash-Next,
# 4 layers). KERNEL is a regex over the MANGLED name (ncu writes the demangled one as gemv_quant_kernel<(int)4, (int)1>,
# which a regex like gemv_quant_kernel<4, 1> never matches); the default is the 1-row decode GEMV, whose 4th-6th
# launches should be a GDN layer's grouped input products, out and router/shared-gate products (130, 80 and 33 blocks
# in details.txt). Other kernels: products_kernelILi1ELb1E, combine_kernelILi1E, hc_down_kernelILi1E, gdn_decode_kernel.
# Writes OUTDIR/profile.tar.xz holding the .ncu-rep, details.txt (every section: warp states, memory, launch) and
# source.csv (per SASS instruction: issue and stall samples by reason; builds without -lineinfo have no source lines):
# one file, because the device tool brings back at most 8.
# Usage: bench/cuda/kernel_ncu.sh OUTDIR VAVILOV_BINARY [KERNEL [SKIP COUNT]]   (~20 s; ncu flushes caches each replay)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:?OUTDIR}
binary=${2:?VAVILOV_BINARY}
kernel=${3:-gemv_quant_kernelILi4ELi1E}
skip=${4:-3}
count=${5:-3}
work=$(mktemp -d)
ncu --set full --import-source yes --clock-control none --kernel-name-base mangled -k "regex:$kernel" \
  --launch-skip "$skip" --launch-count "$count" -f -o "$work/kernel" \
  "$binary" bench --synthetic models/configs/flash-next.json --layers 4 --steps 1 --prefill 8 > "$work/run.txt" 2>&1
ncu -i "$work/kernel.ncu-rep" --page details > "$work/details.txt"
ncu -i "$work/kernel.ncu-rep" --page source --csv --print-source sass > "$work/source.csv" ||
  ncu -i "$work/kernel.ncu-rep" --page source --csv > "$work/source.csv"  # an ncu without --print-source
mkdir -p "$out"
tar -cJf "$out/profile.tar.xz" -C "$work" .
grep -E "Grid Size|Duration|No Instruction|Stall|Issue Slots Busy|Memory Throughput" "$work/details.txt" | head -60
