#!/usr/bin/env bash
# On the device machine, in one call, building nothing (~80 s): checks a build's prefill paths and times the prefill
# against a base binary (branch s10-prefill2's check; its first run is in
# bench/results/2026-12-01-h200-prefill-breakdown-s10.json).
#   1. the synthetic Flash-Next prefill at 512 and 2048 of BASE_VAVILOV and BUILD/vavilov: 8 layers interleaved
#      (base, new, base, new), then 48 layers + MTP once each
#   2. BUILD/vavilov_gpu_tests over the model, linear, MoE, expert and quantized-product suites
#   3. compute-sanitizer memcheck over CudaQuantGemm*
#   4. ncu's per-kernel time of both binaries' 4-layer prefill at 512 (the NVTX range prefill512), kernels in order,
#      and memory metrics of the first layer's routed-expert launches (gate, up, down) of both
# Results go to OUTDIR/prefill_check.tgz (one archive: the device tool brings back at most eight files); the summary
# is printed. A lib/ folder in BUILD goes on LD_LIBRARY_PATH. Run from the repository root (models/configs; and
# VAVILOV_SOURCE_DIR for the test fixtures).
# Usage: prefill_check.sh OUTDIR BUILD BASE_VAVILOV
set -uo pipefail
out=${1:?OUTDIR}
build=${2:?BUILD}
base=${3:?BASE_VAVILOV}
work=${PREFILL_CHECK_WORK:-$(mktemp -d)}  # PREFILL_CHECK_WORK: a folder to keep the raw results in
export LD_LIBRARY_PATH=$build/lib:${LD_LIBRARY_PATH:-}
config=models/configs/flash-next.json
bench() {  # name binary layers
  timeout 90 "$2" bench --synthetic $config --layers "$3" --steps 1 --prefill 512,2048 --out "$work/$1.json" \
    > "$work/$1.log" 2>&1
  python3 -c "import json; print('$1', json.load(open('$work/$1.json'))['prefill_tok_s'])" 2>&1 | tee -a "$work/summary.txt"
}
for i in 1 2; do
  bench base8_$i "$base" 8
  bench new8_$i "$build/vavilov" 8
done
bench base48 "$base" 48
bench new48 "$build/vavilov" 48
timeout 120 "$build/vavilov_gpu_tests" \
  --gtest_filter='*GpuModel*:CudaLinear*:*CudaMoe*:CudaQuantGemm*:CudaExpert*' > "$work/tests.log" 2>&1
echo "tests: exit $? $(grep -E '^\[  (PASSED|FAILED|  SKIPPED) ' "$work/tests.log" | tr '\n' ' ')" | tee -a "$work/summary.txt"
timeout 120 compute-sanitizer --tool memcheck "$build/vavilov_gpu_tests" --gtest_filter='CudaQuantGemm*' \
  > "$work/memcheck.log" 2>&1
echo "memcheck: exit $? $(grep -E 'ERROR SUMMARY|PASSED' "$work/memcheck.log" | tr '\n' ' ')" | tee -a "$work/summary.txt"
ncu_times() {  # name binary: per-kernel time of a 4-layer prefill at 512 (the NVTX range prefill512)
  timeout 60 ncu --clock-control none --cache-control none --nvtx --nvtx-include "prefill512/" \
    --metrics gpu__time_duration.sum --csv --page raw --log-file "$work/ncu_$1.csv" \
    "$2" bench --synthetic $config --layers 4 --steps 1 --prefill 512 --out "$work/ncu_bench.json" > /dev/null 2>&1
  echo "ncu $1: exit $?" | tee -a "$work/summary.txt"
}
ncu_times prefill512 "$build/vavilov"
ncu_times prefill512_base "$base"
# The first GDN layer's routed-expert launches (gate, up, down: the 11th-13th quant_gemm_kernel launches of the
# prefill): memory throughput, L2 hit rate, achieved occupancy.
for name in new base; do
  binary=$build/vavilov
  [ $name = base ] && binary=$base
  timeout 60 ncu --clock-control none --nvtx --nvtx-include "prefill512/" -k regex:quant_gemm_kernel --launch-skip 10 \
    --launch-count 3 --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,\
lts__t_sector_hit_rate.pct,sm__warps_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum --csv \
    --page raw --log-file "$work/ncu_experts_$name.csv" "$binary" bench --synthetic $config --layers 1 --steps 1 \
    --prefill 512 --out "$work/ncu_bench.json" > /dev/null 2>&1
  echo "ncu experts $name: exit $?" | tee -a "$work/summary.txt"
done
tar czf "$out/prefill_check.tgz" -C "$work" .
