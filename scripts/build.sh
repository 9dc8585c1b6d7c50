#!/usr/bin/env bash
# Configures and builds vavilov and its tests into build/ (CUDA parts too when nvcc is on PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)"
