#!/usr/bin/env python3
"""Compare the engine's MTP draft-head logits with the fixtures made by tools/make_mtp_fixtures.py.

Usage:
    python3 tools/check_mtp.py tests/fixtures/models_mtp --binary build/vavilov [-v] [--threads N]
    python3 tools/check_mtp.py tests/fixtures/models_mtp/mtp_f32_hc4 --binary build/vavilov

For every fixture directory (one holding reference.json with "mtp_logits_file") this runs exactly

    BINARY logits --model DIR --ids <prompt_ids, comma-separated> --mtp --out TMP.f32 [--threads N]

and expects TMP.f32 to hold little-endian float32 [(n-1) x vocab] (n = len(prompt_ids)): row i = the MTP head's
logits for the row pairing the trunk's pre-final-mixer stack at position i with token prompt_ids[i+1], the head
run once over rows 0..n-2 as one causal sequence at positions 0..n-2 (see tests/fixtures/models_mtp/README.md).
The `--mtp` flag of the `logits` command is the engine's (written separately); this script only runs it.
Pass: max|engine - ref| / max|ref| <= --tol (1e-4; bf16 fixtures are compared against the fp32 reference of the
bf16 weights with --tol-bf16, 2e-3) and, reported, the argmax agreement with reference.json's mtp_argmax.

Exit status: 0 when every fixture passed, 1 otherwise, 2 on usage errors.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

import numpy as np


def find_fixture_dirs(paths):
    out = []
    for p in paths:
        if os.path.isfile(os.path.join(p, "reference.json")):
            out.append(p)
        elif os.path.isdir(p):
            out.extend(sorted(os.path.join(p, d) for d in os.listdir(p)
                              if os.path.isfile(os.path.join(p, d, "reference.json"))))
        else:
            print(f"warning: {p} is not a directory", file=sys.stderr)
    return [d for d in out if "mtp_logits_file" in json.load(open(os.path.join(d, "reference.json")))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--binary", required=True)
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--tol-bf16", type=float, default=2e-3)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    dirs = find_fixture_dirs(args.dirs)
    if not dirs:
        print("no MTP fixture directories (reference.json with mtp_logits_file) found", file=sys.stderr)
        return 2
    failures = 0
    with tempfile.TemporaryDirectory(prefix="vavilov_mtp_") as tmp:
        for d in dirs:
            ref = json.load(open(os.path.join(d, "reference.json")))
            ids = ref["prompt_ids"]
            V = ref["vocab_size"]
            rows = len(ids) - 1
            want = np.fromfile(os.path.join(d, ref["mtp_logits_file"]), dtype="<f4").reshape(rows, V)
            out = os.path.join(tmp, os.path.basename(os.path.normpath(d)) + ".f32")
            cmd = [args.binary, "logits", "--model", d, "--ids", ",".join(map(str, ids)), "--mtp", "--out", out]
            if args.threads:
                cmd += ["--threads", str(args.threads)]
            name = os.path.basename(os.path.normpath(d))
            if args.verbose:
                print(f"$ {shlex.join(cmd)}")
            t0 = time.time()
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            except (OSError, subprocess.TimeoutExpired) as e:
                print(f"FAIL {name}: {e}")
                failures += 1
                continue
            dt = time.time() - t0
            if r.returncode != 0:
                tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-10:])
                print(f"FAIL {name}: exit {r.returncode} after {dt:.1f}s\n  $ {shlex.join(cmd)[:300]}\n{tail}")
                failures += 1
                continue
            got = np.fromfile(out, dtype="<f4") if os.path.exists(out) else np.zeros(0, np.float32)
            if got.size != rows * V:
                print(f"FAIL {name}: {out} holds {got.size} floats, expected {rows} x {V} = {rows * V}")
                failures += 1
                continue
            got = got.reshape(rows, V)
            if not np.isfinite(got).all():
                print(f"FAIL {name}: non-finite values in the engine's MTP logits")
                failures += 1
                continue
            err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
            tol = args.tol_bf16 if ref.get("weights_dtype") == "bfloat16" else args.tol
            agree = float((got.argmax(-1) == np.array(ref["mtp_argmax"])).mean())
            worst = int(np.abs(got - want).max(axis=1).argmax())
            ok = err <= tol
            failures += not ok
            print(f"{'PASS' if ok else 'FAIL'} {name}: mtp logits rel err {err:.2e} (tol {tol:.0e}), argmax agreement "
                  f"{agree:.3f}, worst row {worst}, {dt:.1f}s")
    print(f"{len(dirs) - failures}/{len(dirs)} MTP fixtures passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
