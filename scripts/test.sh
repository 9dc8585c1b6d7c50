#!/usr/bin/env bash
# Installs what the tests need, builds, and runs the whole suite (CPU tests; GPU tests run on the device).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/install_python_deps.sh
scripts/build.sh
ctest --test-dir build -L cpu --output-on-failure -j "$(nproc)"
