#!/usr/bin/env bash
# On the GPU machine, from the repository root, in one device call: the hyper-connection read's tests and the decode
# step against a base binary (session 8: the one-kernel read of branch s8-hcone's commits 9878908, 4423f34 and 4f56dea,
# each built into its own vavilov and passed in VARIANTS; docs/CUDA.md has what they measured).
#   bench/cuda/hc_one_check.sh BUILD_DIR BASE_VAVILOV [OUT_DIR]
# BUILD_DIR holds vavilov_gpu_tests and the vavilov binaries named in VARIANTS (default: vavilov). Stages, each under
# its own timeout with a summary line: "tests" (CudaHc*, *GpuModel*), "bench" (`vavilov bench --synthetic flash-next
# --layers 12 --steps 10 --prefill 64`, base and each variant interleaved, twice), "memcheck" (CudaHc*), "racecheck"
# (the small geometries and the late-producer test), "bench48" (one 48-layer run of each), "ncu" (per-kernel times of
# the hyper-connection kernels, 4 layers, base and vavilov). STAGES picks them (default "tests bench memcheck
# racecheck"); BUDGET (seconds, default 105) bounds the call: each stage's timeout is cut to what is left.
set -uo pipefail
build=${1:?BUILD_DIR}
base=${2:?BASE_VAVILOV}
out=${3:-${OUT:-/tmp/hcone}}
stages=${STAGES:-tests bench memcheck racecheck}
variants=${VARIANTS:-vavilov}
budget=${BUDGET:-105}
mkdir -p "$out"
export VAVILOV_SOURCE_DIR=${VAVILOV_SOURCE_DIR:-$PWD}
tests=$build/vavilov_gpu_tests
summary=$out/summary.txt
note() { echo "$1" | tee -a "$summary"; }
has() { [[ " $stages " == *" $1 "* ]]; }
gtest() {  # NAME SECONDS FILTER [TOOL...]
  local name=$1 seconds=$2 filter=$3
  shift 3
  ((seconds > budget - SECONDS)) && seconds=$((budget - SECONDS))
  if ((seconds < 5)); then
    note "$name: skipped (out of time)"
    return
  fi
  local start=$SECONDS
  if timeout "$seconds" "$@" "$tests" --gtest_brief=1 --gtest_filter="$filter" > "$out/$name.log" 2>&1; then
    note "$name ($filter): PASS in $((SECONDS - start)) s"
  else
    note "$name ($filter): FAIL or timeout after $((SECONDS - start)) s"
    tail -30 "$out/$name.log" | tee -a "$summary"
  fi
}
step_ms() { python3 -c "import json,sys;print(json.load(open(sys.argv[1]))['step_ms'])" "$1" 2>/dev/null || echo none; }
bench() {  # NAME BINARY LAYERS
  local start=$SECONDS seconds=$((budget - SECONDS))
  ((seconds > 60)) && seconds=60
  if ((seconds < 5)); then
    note "$1: skipped (out of time)"
    return
  fi
  timeout "$seconds" "$2" bench --synthetic models/configs/flash-next.json --layers "$3" --steps 10 --prefill 64 \
    --out "$out/$1.json" > "$out/$1.log" 2>&1
  note "$1: step_ms $(step_ms "$out/$1.json") ($((SECONDS - start)) s)"
}

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$summary"
has tests && gtest tests 50 'CudaHc*:*GpuModel*'
if has bench; then
  for round in 1 2; do
    bench "base-12-$round" "$base" 12
    for v in $variants; do bench "$v-12-$round" "$build/$v" 12; done
  done
fi
sanitizer="compute-sanitizer --error-exitcode 3 --print-limit 20"
has memcheck && gtest memcheck 30 'CudaHc*' $sanitizer --tool memcheck
racecheck_filter='CudaHcRead.SmallGeometries*:CudaHcRead.AfterLateProducer*'
has racecheck && gtest racecheck 20 "$racecheck_filter" $sanitizer --tool racecheck
if has bench48; then
  bench base-48 "$base" 48
  for v in $variants; do bench "$v-48" "$build/$v" 48; done
fi
if has ncu; then
  for b in base:$base vavilov:$build/vavilov; do
    seconds=$((budget - SECONDS))
    ((seconds > 30)) && seconds=30
    ((seconds < 5)) && break
    timeout "$seconds" ncu --clock-control none --metrics gpu__time_duration.sum -k regex:hc_ --launch-skip 100 \
      --launch-count 40 --print-summary per-kernel "${b#*:}" bench --synthetic models/configs/flash-next.json \
      --layers 4 --steps 3 --prefill 64 > "$out/ncu-${b%%:*}.txt" 2>&1
    note "ncu ${b%%:*}: $out/ncu-${b%%:*}.txt"
  done
fi
