#!/usr/bin/env bash
# Python packages for the reference tools the tests run (pinned in tools/requirements*.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
pip=(python3 -m pip install --quiet --disable-pip-version-check)
for requirements in tools/requirements*.txt; do
  "${pip[@]}" -r "$requirements" 2>/dev/null || "${pip[@]}" --break-system-packages -r "$requirements"
done
