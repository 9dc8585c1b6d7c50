#!/usr/bin/env bash
# Builds (unless BUILD_DIR already holds them) and runs the GPU tests, then compute-sanitizer's memcheck over a subset
# when the tool is there. Run from the repository root on a machine with a CUDA GPU:
#   tests/gpu/run_gpu_tests.sh [BUILD_DIR]        (default: build)
# Binaries built elsewhere can be run from a copy of the tree: VAVILOV_SOURCE_DIR points the tests at its fixtures.
set -euo pipefail
build=${1:-build}
tests=$build/vavilov_gpu_tests
if [[ ! -x $tests ]]; then
  cmake -S . -B "$build" -G Ninja
  ninja -C "$build" vavilov vavilov_gpu_tests
fi
export VAVILOV_SOURCE_DIR=${VAVILOV_SOURCE_DIR:-$PWD}
status=0
"$tests" --gtest_brief=1 || status=1
if command -v compute-sanitizer > /dev/null; then
  # One F32 fixture with PLE and one with the MTP head cover every kernel (the fused greedy step included), the MoE
  # tests the decode block and the router, CudaProductGroups the grouped products, CudaGdn the GDN kernels at the
  # release's shape, the format tests every weight format's loaders and the NVFP4 GEMV, CudaHc* the fused
  # hyper-connection read, CudaAttention* the split attention and its inputs, CudaLinear the dense and expert GEMV
  # launches, CudaQuantGemm the prefill products, CudaDependentLaunch the early starts (late-writing producers);
  # memcheck slows them ~100x: one process did not finish within 10 minutes on an H200, so MEMCHECK_SHARDS (default
  # 4) gtest shards run side by side on the one GPU (~8.5 minutes), each writing memcheck-N.log in the build directory.
  filter='*tiny_f32_hc4_ple1:*mtp_f32_hc4:*CudaMoe*:*CudaExpertDecode*:CudaProductGroups.*:CudaGdn.*:CudaFormats.*:GpuFormats.MlxCheckpoint*:GpuFormats.Nvfp4Checkpoint*:CudaHc*:CudaAttention*:CudaLinear.*:CudaQuantGemm.*:CudaDependentLaunch.*'
  shards=${MEMCHECK_SHARDS:-4}
  pids=()
  for ((i = 0; i < shards; ++i)); do
    GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i compute-sanitizer --tool memcheck --error-exitcode 3 \
      --print-limit 20 "$tests" --gtest_brief=1 --gtest_filter="$filter" > "$build/memcheck-$i.log" 2>&1 &
    pids+=($!)
  done
  for ((i = 0; i < shards; ++i)); do
    wait "${pids[i]}" || { status=1; echo "memcheck shard $i failed: $build/memcheck-$i.log"; }
    grep -E "ERROR SUMMARY|FAILED" "$build/memcheck-$i.log" || true
  done
else
  echo "compute-sanitizer not found: memcheck skipped"
fi
exit $status
