#!/usr/bin/env bash
# Encode throughput, vavilov vs HF `tokenizers`, single thread, on tests/fixtures/tokenizer/corpus.bin.
# Usage: bench/tokenizer/run.sh [LIBRARY]   (the static library with the tokenizer; default build-tok/libvavilov_lib.a)
# Writes bench/results/<date>-tokenizer-cpu.json.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
library=${1:-$repo/build-tok/libvavilov_lib.a}
tokenizers_dir=${VAVILOV_TOKENIZERS:-$repo/../shared/data/tokenizers}
corpus=$repo/tests/fixtures/tokenizer/corpus.bin
repeats=5
binary=$(mktemp -d)/encode_bench
g++ -std=c++20 -O2 -DNDEBUG -I"$repo/src" "$repo/bench/tokenizer/encode_bench.cpp" -o "$binary" \
  "$library" $(pkg-config --libs libpcre2-8 libutf8proc) -lfmt

results=()
for name in qwen3 deepseek_v3; do
  ours=$(taskset -c 0 "$binary" "$tokenizers_dir/$name" "$corpus" "$repeats")
  hf=$(taskset -c 0 python3 "$repo/bench/tokenizer/hf_encode_bench.py" "$tokenizers_dir/$name" "$corpus" "$repeats")
  results+=("\"$name\": {\"vavilov\": $ours, \"hf_tokenizers\": $hf}")
done
date=$(date +%Y-%m-%d)
cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
commit=$(git -C "$repo" rev-parse --short HEAD)
out=$repo/bench/results/$date-tokenizer-cpu.json
{
  echo "{\"date\": \"$date\", \"cpu\": \"$cpu\", \"commit\": \"$commit\", \"threads\": 1, \"repeats\": $repeats,"
  echo " \"corpus\": \"tests/fixtures/tokenizer/corpus.bin\","
  (IFS=,; echo " ${results[*]}}")
} | python3 -m json.tool > "$out"
cat "$out"
