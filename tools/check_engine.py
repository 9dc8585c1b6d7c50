#!/usr/bin/env python3
"""Compare the Vavilov engine with the HF reference fixtures made by tools/make_fixtures.py.

Usage:
    python3 tools/check_engine.py tests/fixtures/models/* --binary build/vavilov
    python3 tools/check_engine.py tests/fixtures/models --binary build/vavilov     # a root of fixture dirs works too

For every fixture directory (one holding reference.json):
  * logits: runs `BINARY logits --model DIR --ids 1,2,3 --out TMP.f32` one-shot, then again with `--chunk 5` and
    `--chunk 1`, reads TMP.f32 (little-endian float32, [len(prompt_ids) x vocab]) and reports
    max|engine - ref| / max|ref| against logits.f32.  Fails above --tol-f32 (1e-4) for float32 fixtures and
    --tol-bf16 (2e-3) for bfloat16 fixtures.  For bfloat16 fixtures it also reports (never fails on) the distance to
    logits_native.f32 (HF run natively in bf16).
  * generate: if the binary supports it, runs `BINARY generate --model DIR --ids ... --max-tokens 24 --ignore-eos`,
    expects the generated ids as a JSON array on stdout (the last line that parses as a JSON array of ints is
    taken) and compares them with greedy_ids.  If the subcommand is not supported (non-zero exit with a usage /
    unknown-command message, or no JSON array printed) the check is reported as SKIP, not FAIL; use
    --require-generate to make that a failure.

Exit status: 0 when every executed check passed, 1 otherwise, 2 on usage errors.
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

UNSUPPORTED_HINTS = ("unknown command", "unknown subcommand", "unrecognized", "usage", "not supported",
                     "not implemented", "invalid command", "unknown mode")


def find_fixture_dirs(paths):
    out = []
    for p in paths:
        if os.path.isfile(os.path.join(p, "reference.json")):
            out.append(p)
        elif os.path.isdir(p):
            subs = sorted(os.path.join(p, d) for d in os.listdir(p)
                          if os.path.isfile(os.path.join(p, d, "reference.json")))
            if not subs:
                print(f"warning: {p} holds no reference.json (and no fixture sub-directories)", file=sys.stderr)
            out.extend(subs)
        else:
            print(f"warning: {p} is not a directory", file=sys.stderr)
    return out


def run(cmd, timeout):
    t0 = time.time()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return r.returncode, r.stdout, r.stderr, time.time() - t0
    except subprocess.TimeoutExpired as e:
        return 124, e.stdout or "", (e.stderr or "") + f"\n[timed out after {timeout}s]", time.time() - t0
    except OSError as e:
        return 127, "", f"cannot execute {cmd[0]}: {e}", time.time() - t0


def tail(text, n=15):
    lines = (text or "").strip().splitlines()
    return "\n".join("      | " + l for l in lines[-n:])


def load_f32(path, rows, vocab):
    data = np.fromfile(path, dtype="<f4")
    if data.size != rows * vocab:
        raise ValueError(f"{path}: {data.size} floats, expected {rows} x {vocab} = {rows * vocab}")
    return data.reshape(rows, vocab)


def compare(eng, ref):
    """max|eng - ref| / max|ref|, plus where it happens and whether the argmax rows agree."""
    if not np.all(np.isfinite(eng)):
        bad = np.argwhere(~np.isfinite(eng))[0]
        return float("inf"), f"non-finite value at row {bad[0]} col {bad[1]}"
    diff = np.abs(eng.astype(np.float64) - ref.astype(np.float64))
    scale = max(float(np.abs(ref).max()), 1e-30)
    worst = np.unravel_index(int(diff.argmax()), diff.shape)
    argmax_mismatch = int((eng.argmax(-1) != ref.argmax(-1)).sum())
    detail = (f"max|d|={diff.max():.3e} at row {worst[0]} col {worst[1]} (ref {ref[worst]:+.5f}, eng {eng[worst]:+.5f}),"
              f" max|ref|={scale:.3f}, argmax mismatches {argmax_mismatch}/{ref.shape[0]}")
    # first row that goes bad helps to tell prefill bugs (row 0) from state/cache bugs (later rows)
    row_err = diff.max(-1) / scale
    first_bad = int(np.argmax(row_err > 1e-4)) if (row_err > 1e-4).any() else None
    if first_bad is not None:
        detail += f"; first row above 1e-4: {first_bad}"
    return float(diff.max() / scale), detail


def parse_ids(stdout):
    for line in reversed((stdout or "").strip().splitlines()):
        line = line.strip()
        if not (line.startswith("[") and line.endswith("]")):
            continue
        try:
            v = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(v, list) and all(isinstance(x, int) for x in v):
            return v
    return None


def check_fixture(d, args, tmpdir):
    ref = json.load(open(os.path.join(d, "reference.json")))
    name = os.path.basename(os.path.normpath(d))
    ids = ref["prompt_ids"]
    vocab = ref["vocab_size"]
    dtype = ref.get("weights_dtype", "float32")
    tol = args.tol_bf16 if dtype == "bfloat16" else args.tol_f32
    ref_logits = load_f32(os.path.join(d, ref.get("logits_file", "logits.f32")), len(ids), vocab)
    native = None
    if ref.get("logits_native_file") and os.path.exists(os.path.join(d, ref["logits_native_file"])):
        native = load_f32(os.path.join(d, ref["logits_native_file"]), len(ids), vocab)
    ids_arg = ",".join(str(i) for i in ids)
    print(f"== {name}  ({dtype}, {len(ids)} prompt tokens, vocab {vocab}, tol {tol:g})")
    results = []

    for chunk in args.chunks:
        label = "logits one-shot" if chunk is None else f"logits --chunk {chunk}"
        out = os.path.join(tmpdir, f"{name}_{chunk}.f32")
        if os.path.exists(out):
            os.remove(out)
        cmd = [args.binary, "logits", "--model", d, "--ids", ids_arg, "--out", out]
        if chunk is not None:
            cmd += ["--chunk", str(chunk)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        rc, so, se, dt = run(cmd, args.timeout)
        if rc != 0:
            print(f"  FAIL {label}: exit {rc} after {dt:.1f}s\n      $ {shlex.join(cmd)[:300]}\n{tail(se or so)}")
            results.append(False)
            continue
        try:
            eng = load_f32(out, len(ids), vocab)
        except (OSError, ValueError) as e:
            print(f"  FAIL {label}: {e}")
            results.append(False)
            continue
        err, detail = compare(eng, ref_logits)
        ok = err <= tol
        extra = ""
        if native is not None:
            nerr, _ = compare(eng, native)
            extra = f"  [vs HF native bf16: {nerr:.2e}, informational]"
        print(f"  {'ok  ' if ok else 'FAIL'} {label}: rel err {err:.3e} ({dt:.1f}s){extra}")
        if not ok or args.verbose:
            print(f"      {detail}")
        results.append(ok)

    if not args.no_generate:
        label = "generate 24 --ignore-eos"
        cmd = [args.binary, "generate", "--model", d, "--ids", ids_arg, "--max-tokens", str(len(ref["greedy_ids"])),
               "--ignore-eos"]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        rc, so, se, dt = run(cmd, args.timeout)
        got = parse_ids(so) if rc == 0 else None
        unsupported = rc != 0 and any(h in (se + so).lower() for h in UNSUPPORTED_HINTS)
        if got is None and (unsupported or rc == 0) and not args.require_generate:
            why = "no JSON id array on stdout" if rc == 0 else f"exit {rc}, looks unsupported"
            print(f"  SKIP {label}: {why}")
        elif got is None:
            print(f"  FAIL {label}: exit {rc} after {dt:.1f}s\n      $ {shlex.join(cmd)[:300]}\n{tail(se or so)}")
            results.append(False)
        else:
            want = ref["greedy_ids"]
            # tolerate an engine that echoes the prompt before the continuation
            if len(got) == len(ids) + len(want) and got[:len(ids)] == ids:
                got = got[len(ids):]
            ok = got == want
            if ok:
                print(f"  ok   {label}: {len(want)} ids match ({dt:.1f}s)")
            else:
                first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                print(f"  FAIL {label}: first mismatch at step {first} (len got {len(got)}, want {len(want)})\n"
                      f"      want {want}\n      got  {got}\n"
                      f"      (smallest reference top-1/top-2 margin {ref.get('min_greedy_margin', '?')})")
            results.append(ok)
    return all(results), len(results)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", help="fixture directories (or roots holding them)")
    ap.add_argument("--binary", required=True, help="path to the engine executable")
    ap.add_argument("--tol-f32", type=float, default=1e-4)
    ap.add_argument("--tol-bf16", type=float, default=2e-3)
    ap.add_argument("--chunks", default="none,5,1",
                    help="comma list of chunk sizes to test; 'none' = no --chunk flag (default none,5,1)")
    ap.add_argument("--threads", type=int, default=0, help="pass --threads N to the engine (0: don't pass)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per engine invocation")
    ap.add_argument("--no-generate", action="store_true", help="skip the generate comparison")
    ap.add_argument("--require-generate", action="store_true", help="an unsupported generate is a failure")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    args.chunks = [None if c.strip().lower() == "none" else int(c) for c in args.chunks.split(",") if c.strip()]

    if not (os.path.isfile(args.binary) and os.access(args.binary, os.X_OK)):
        print(f"error: --binary {args.binary} is not an executable file", file=sys.stderr)
        return 2
    args.binary = os.path.abspath(args.binary)
    dirs = find_fixture_dirs(args.dirs)
    if not dirs:
        print("error: no fixture directories found", file=sys.stderr)
        return 2
    failed = []
    n_checks = 0
    with tempfile.TemporaryDirectory(prefix="vavilov_check_") as tmpdir:
        for d in dirs:
            try:
                ok, n = check_fixture(d, args, tmpdir)
            except Exception as e:  # a broken fixture must not hide the others
                print(f"  FAIL {d}: {type(e).__name__}: {e}")
                ok, n = False, 1
            n_checks += n
            if not ok:
                failed.append(os.path.basename(os.path.normpath(d)))
    print(f"\n{len(dirs) - len(failed)}/{len(dirs)} fixtures passed ({n_checks} checks)"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
