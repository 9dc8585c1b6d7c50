#!/usr/bin/env bash
# The expert cache on the device machine (docs/CUDA.md, "Routed experts from host memory"): its GPU tests, memcheck over
# one fixture's, and `vavilov bench` at 12 layers without the cache and at 0 MB, ~25 % and 100 % of the 12 layers'
# routed expert bytes (512 experts x 2.64 MiB x 12 = 16200 MiB). Usage: expert_cache_check.sh BUILD_DIR OUT_DIR [COMMIT]
set -u
build=$1 out=$2 commit=${3:-unknown}
deadline=$(($(date +%s) + ${EXPERT_CACHE_CHECK_SECONDS:-105}))
# Seconds for the next step: at most $1, leaving $2 for the steps after it.
allow() {
  local left=$((deadline - $(date +%s) - $2))
  echo $((left < $1 ? (left > 1 ? left : 1) : $1))
}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv > "$out/gpu.txt" 2>&1
timeout "$(allow 30 75)" "$build/vavilov_gpu_tests" --gtest_filter='*ExpertCache*' > "$out/tests.txt" 2>&1
echo "rc=$?" >> "$out/tests.txt"
timeout "$(allow 20 55)" compute-sanitizer --tool memcheck --error-exitcode 9 "$build/vavilov_gpu_tests" \
  --gtest_filter='Fixtures/GpuExpertCacheFixture.BitIdentical*/mtp_f32_hc4' > "$out/memcheck.txt" 2>&1
echo "rc=$?" >> "$out/memcheck.txt"
# Per run: the most seconds it gets and those kept for the runs after it; the run without the cache last (baseline).
for run in 0:30:36 16200:20:18 4050:20:8 none:15:0; do
  IFS=: read -r mb most keep <<< "$run"
  cache=()
  [ "$mb" != none ] && cache=(--expert-cache-mb "$mb")
  start=$(date +%s)
  timeout "$(allow "$most" "$keep")" "$build/vavilov" bench --synthetic models/configs/flash-next.json --layers 12 --steps 10 --prefill 64 \
    ${cache[@]+"${cache[@]}"} --commit "$commit" --out "$out/bench-$mb.json" > "$out/bench-$mb.log" 2>&1
  echo "rc=$? wall_s=$(($(date +%s) - start))" >> "$out/bench-$mb.log"
done
