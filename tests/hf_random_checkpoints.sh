#!/usr/bin/env bash
# Fresh random checkpoints from transformers (shapes, layouts, dtypes, n-gram orders varied) must match too,
# not only the committed fixtures. Usage: hf_random_checkpoints.sh VAVILOV_BINARY
set -euo pipefail
binary=$1
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 "$root/tools/make_fixtures.py" --random 4 --seed 2026 --out "$work/plain" >/dev/null
python3 "$root/tools/make_fixtures.py" --random 3 --seed 2027 --wild --out "$work/wild" >/dev/null
python3 "$root/tools/check_engine.py" "$work/plain" "$work/wild" --binary "$binary" --require-generate
