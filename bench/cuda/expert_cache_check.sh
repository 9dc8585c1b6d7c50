#!/usr/bin/env bash
# The expert cache on the device machine (docs/CUDA.md, "Routed experts from host memory"): its GPU tests, memcheck over
# one fixture's, and `vavilov bench` at 12 layers without the cache and at 0 MB, ~25 % and 100 % of the 12 layers'
# routed expert bytes (512 experts x 2.64 MiB x 12 = 16200 MiB). Usage: expert_cache_check.sh BUILD_DIR OUT_DIR [COMMIT]
set -u
build=$1 out=$2 commit=${3:-unknown}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv > "$out/gpu.txt" 2>&1
timeout 45 "$build/vavilov_gpu_tests" --gtest_filter='*ExpertCache*' > "$out/tests.txt" 2>&1
echo "rc=$?" >> "$out/tests.txt"
timeout 25 compute-sanitizer --tool memcheck --error-exitcode 9 "$build/vavilov_gpu_tests" \
  --gtest_filter='Fixtures/GpuExpertCacheFixture.*/mtp_f32_hc4' > "$out/memcheck.txt" 2>&1
echo "rc=$?" >> "$out/memcheck.txt"
for mb in 0 4050 16200 none; do
  cache=()
  [ "$mb" != none ] && cache=(--expert-cache-mb "$mb")
  start=$(date +%s.%N)
  timeout 40 "$build/vavilov" bench --synthetic models/configs/flash-next.json --layers 12 --steps 10 --prefill 64 \
    "${cache[@]}" --commit "$commit" --out "$out/bench-$mb.json" > "$out/bench-$mb.log" 2>&1
  echo "rc=$? wall=$(echo "$(date +%s.%N) - $start" | bc)" >> "$out/bench-$mb.log"
done
