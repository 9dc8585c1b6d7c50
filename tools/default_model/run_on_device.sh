#!/usr/bin/env bash
# Trains the bundled default model on the device (one NVIDIA H200; no network) and writes
#   $OUT/default_model/            HF model directory (config.json, model.safetensors with mtp.*, tokenizer files,
#                                  generation_config.json) + train_report.json
#   $OUT/default_model/check_patch.log   the vectorised-indexer check (must say PASS)
#   $OUT/default_model/train.log         the training log
# Needs build/default_model/corpus.jsonl.gz and build/default_model/tokenizer/ carried from the preparing machine
# (made by make_corpus.py and train_tokenizer.py); if they are missing they are rebuilt from local files, which
# only works where the same Python packages are installed.
# Usage: OUT=/some/dir tools/default_model/run_on_device.sh [extra train.py flags, e.g. --minutes 6]
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-build/default_model/out}
DATA=build/default_model
DEST="$OUT/default_model"
mkdir -p "$DEST"
T0=$(date +%s)
if [ ! -f "$DATA/corpus.jsonl.gz" ]; then
  echo "corpus archive missing: rebuilding it from this machine's files" >&2
  python3 tools/default_model/make_corpus.py
fi
if [ ! -f "$DATA/tokenizer/tokenizer.json" ]; then
  python3 tools/default_model/train_tokenizer.py
fi
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"
CUDA_VISIBLE_DEVICES= python3 tools/default_model/train.py --check-patch 2>&1 | grep -v "falling back" | tee "$DEST/check_patch.log"
grep -q "check-patch: PASS" "$DEST/check_patch.log"
python3 tools/default_model/train.py --device cuda --minutes 7 --out "$DEST" "$@" 2>&1 \
  | grep --line-buffered -v "falling back" | tee "$DEST/train.log"
cp "$DATA/corpus_manifest.json" "$DEST/corpus_manifest.json" 2>/dev/null || true
echo "done in $(( $(date +%s) - T0 )) s: $DEST"
ls -la "$DEST"
