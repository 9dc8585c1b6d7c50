#!/usr/bin/env python3
"""Decode speed on the GPU of a packed store against the same checkpoint quantized in memory (issue 9).

Makes a real-width synthetic checkpoint (tools/make_synthetic_checkpoint.py: hidden 2560, experts [640 x 2560],
vocabulary 248320, BF16; fewer layers and experts), packs it with `vavilov pack --experts 4,3,2`, then runs
`vavilov bench --weights q4` on the checkpoint (every matrix quantized to Q4 at load) and on the store (its Q4
expert records mapped as packed, the dense BF16 tensors quantized to Q4 at load), so both put the same formats on
the GPU and differ only in where the expert bytes came from; then on the store with `--experts 3` and `2` (its 3- and
2-bit records). Writes one JSON with every bench result.

    python3 bench/pack/bench_store_decode.py --binary build/vavilov --work /tmp/store-decode \\
        --out bench/results/$(date -u +%F)-h200-store-decode.json --commit $(git rev-parse --short HEAD)
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(command: list) -> float:
    print("+", " ".join(command), flush=True)
    start = time.time()
    subprocess.run(command, check=True)
    return time.time() - start


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", required=True)
    ap.add_argument("--work", required=True, help="scratch directory (removed first)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--reuse", action="store_true",
                    help="measure WORK/checkpoint and WORK/store made earlier (with these --layers/--experts)")
    args = ap.parse_args()

    checkpoint, store = os.path.join(args.work, "checkpoint"), os.path.join(args.work, "store")
    make_s = pack_s = None
    if not args.reuse:
        shutil.rmtree(args.work, ignore_errors=True)
        os.makedirs(args.work)
        make_s = run([sys.executable, os.path.join(ROOT, "tools/make_synthetic_checkpoint.py"), "--config",
                      os.path.join(ROOT, "models/configs/flash-next.json"), "--layers", str(args.layers),
                      "--experts", str(args.experts), "--out", checkpoint])
        pack_s = run([args.binary, "pack", "--model", checkpoint, "--out", store, "--experts", "4,3,2"])
    results = {}
    runs = (("checkpoint_q4_in_memory", checkpoint, []), ("packed_store_q4_experts", store, []),
            ("packed_store_q3_experts", store, ["--experts", "3"]), ("packed_store_q2_experts", store, ["--experts", "2"]))
    for name, path, extra in runs:
        out = os.path.join(args.work, name + ".json")
        try:
            run([args.binary, "bench", "--model", path, "--weights", "q4", "--steps", str(args.steps), "--prefill",
                 "512", "--commit", args.commit, "--out", out] + extra)
        except subprocess.CalledProcessError as error:  # keep the other measurements
            print(error, file=sys.stderr)
            continue
        with open(out) as f:
            results[name] = json.load(f)
    a, b = results.get("checkpoint_q4_in_memory", {}), results.get("packed_store_q4_experts", {})
    any_result = next(iter(results.values()))
    summary = {
        "date": any_result["date"],
        "gpu": any_result["gpu"],
        "commit": args.commit,
        "what": "vavilov bench --weights q4 on a synthetic real-width checkpoint (quantized at load) and on its packed "
                "store (Q4 expert records, dense tensors quantized at load): same formats on the GPU; the store also "
                "with its 3- and 2-bit expert records (--experts 3, 2)",
        "checkpoint": {"layers": args.layers, "experts": args.experts, "bytes": dir_bytes(checkpoint),
                       "make_s": make_s},
        "store": {"bytes": dir_bytes(store), "pack_s": pack_s},
        "step_ms": {k: {name: r["step_ms"][k] for name, r in results.items()} for k in any_result["step_ms"]},
        "store_over_checkpoint_decode_tok_s":
            {k: b["decode_tok_s"][k] / a["decode_tok_s"][k] for k in a.get("decode_tok_s", {}) if b},
        "results": results,
    }
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    print(json.dumps({k: summary[k] for k in ("step_ms", "store_over_checkpoint_decode_tok_s")}, indent=2))


if __name__ == "__main__":
    main()
