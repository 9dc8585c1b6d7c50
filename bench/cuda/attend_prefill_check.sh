#!/usr/bin/env bash
# On the device machine, in one call, building nothing (~90 s): checks the several-row attention (attend_prefill.cu)
# and the prefill selection (qsa) and times the prefill against a base binary (branches s11-attn and s11-attn2; their
# runs are in bench/results/2026-12-01-h200-prefill-attention-s11.json and ...-prefill-attention-long-s11.json).
#   1. BUILD/vavilov_gpu_tests over CudaAttention* and the model suites
#   2. compute-sanitizer memcheck over the prefill attention and selection tests and one fixture's logits
#   3. the synthetic Flash-Next prefill (4 layers: 3 GDN + 1 attention) at 512, 4096, 8192, 16384 and 32768 tokens,
#      base and new interleaved twice
#   4. ncu's per-kernel time of the attention kernels (attend, qsa) of both binaries' 4-layer prefill at 8192 and
#      16384 tokens, per NVTX range
# The summary is printed and written to OUTDIR/summary.txt, ncu's rows to OUTDIR/ncu-{base,new}.csv. A lib/ folder in
# BUILD goes on LD_LIBRARY_PATH. Run from the repository root (models/configs; VAVILOV_SOURCE_DIR for the fixtures).
# Usage: attend_prefill_check.sh OUTDIR BUILD BASE_VAVILOV
set -uo pipefail
out=${1:?OUTDIR}
build=${2:?BUILD}
base=${3:?BASE_VAVILOV}
export LD_LIBRARY_PATH=$build/lib:${LD_LIBRARY_PATH:-}
tests=$build/vavilov_gpu_tests
summary=$out/summary.txt
say() { echo "$*" | tee -a "$summary"; }
timeout 35 "$tests" --gtest_brief=1 --gtest_filter='CudaAttention*:*GpuModel*' > "$out/tests.txt" 2>&1
say "tests: exit $? $(grep -E '^\[  (PASSED|FAILED|  SKIPPED) ' "$out/tests.txt" | tr '\n' ' ')"
grep -A5 "Failure" "$out/tests.txt" | head -30
timeout 35 compute-sanitizer --tool memcheck --error-exitcode 3 --print-limit 10 "$tests" --gtest_brief=1 \
  --gtest_filter='CudaAttention.Prefill*:CudaAttentionInputs.Selection*:*GpuModel.LogitsMatch*/tiny_f32_hc4_ple1' \
  > "$out/memcheck.txt" 2>&1
say "memcheck: exit $? $(grep -E 'ERROR SUMMARY|PASSED' "$out/memcheck.txt" | tr '\n' ' ')"
config="--synthetic models/configs/flash-next.json --layers 4 --steps 1 --prefill 512,4096,8192,16384,32768"
bench() {  # name binary
  rm -f /tmp/attend_check.json
  timeout 30 "$2" bench $config --out /tmp/attend_check.json > "$out/bench-$1.log" 2>&1
  say "$1 $(python3 -c "import json; d = json.load(open('/tmp/attend_check.json'))
print({k: round(v) for k, v in d['prefill_tok_s'].items()}, 'step_ms', {k: round(v, 4) for k, v in d['step_ms'].items()})" 2>&1)"
}
for i in 1 2; do
  bench base "$base"
  bench new "$build/vavilov"
done
ncu_times() {  # name binary
  timeout 25 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --nvtx --print-units base \
    -k 'regex:attend|qsa' --csv "$2" bench ${config%%--prefill*}--prefill 8192,16384 --out /tmp/attend_check_ncu.json \
    > "$out/ncu-$1.csv" 2> /dev/null
  python3 - "$out/ncu-$1.csv" "$1" <<'PY' | tee -a "$summary"
import collections, csv, sys
lines = open(sys.argv[1]).read().splitlines()
start = [k for k, l in enumerate(lines) if l.startswith('"ID"')]
if not start:
    print("ncu", sys.argv[2], "no rows")
    sys.exit()
rows = list(csv.reader(lines[start[0]:]))
head = rows[0]
total = collections.defaultdict(lambda: [0, 0.0])
for r in rows[1:]:
    if len(r) < len(head) or r[head.index("Metric Name")] != "gpu__time_duration.sum":
        continue
    ranges = ",".join(r[:8])
    where = next((x for x in ("prefill32768", "prefill16384", "prefill8192", "prefill4096", "prefill512") if x in ranges),
                 "other")
    kernel = r[head.index("Kernel Name")].split("(")[0].split("::")[-1][:30]
    total[(where, kernel)][0] += 1
    total[(where, kernel)][1] += float(r[head.index("Metric Value")].replace(",", ""))
for (where, kernel), (n, ns) in sorted(total.items()):
    print("ncu", sys.argv[2], where, kernel, n, "launches", round(ns / 1000, 1), "us")
PY
}
ncu_times new "$build/vavilov"
ncu_times base "$base"
