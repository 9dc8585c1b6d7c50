#!/usr/bin/env bash
# Everything from a fresh Debian 12 machine to a built engine.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
scripts/build.sh
