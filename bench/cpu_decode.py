#!/usr/bin/env python3
"""CPU decode and prefill speed of `vavilov generate` on a model directory, per thread count and draft setting.

Writes a JSON result with date, CPU, commit and the measured tokens/s to bench/results/.
    python3 bench/cpu_decode.py --model DIR [--threads 1,2] [--drafts 0,1,2,3] [--tokens 128] [--repeat 3]
        [--temperature 0.7 --seed 1 --sampling "--top-p 0.95"]

With --temperature > 0 the runs sample (speculation stays on); outputs then differ between draft settings, so only
greedy runs are required to agree. The per-draft-position acceptance is in each run's "acceptance".
"""
import argparse
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run_once(binary, model, ids, tokens, threads, drafts, mode, sampling):
    cmd = [binary, "generate", "--model", model, "--ids", ids, "--max-tokens", str(tokens), "--ignore-eos",
           "--threads", str(threads), "--drafts", str(drafts), "--draft-mode", mode] + sampling
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    m = re.search(r"prefill: (\d+) tokens, ([\d.]+) tok/s \| decode: (\d+) tokens, ([\d.]+) tok/s", out.stderr)
    result = {"prefill_tok_s": float(m.group(2)), "decode_tok_s": float(m.group(4)), "generated": int(m.group(3))}
    s = re.search(r"mean accepted ([\d.]+), ([\d.]+) tokens/step", out.stderr)
    if s:
        result["mean_accepted"] = float(s.group(1))
        result["tokens_per_step"] = float(s.group(2))
        result["acceptance"] = [
            {"accepted": int(a), "proposed": int(p)} for a, p in re.findall(r"d\d+: (\d+)/(\d+)", out.stderr)]
    result["ids"] = json.loads(out.stdout.splitlines()[0])
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--binary", default=os.path.join(ROOT, "build", "vavilov"))
    ap.add_argument("--ids", help="prompt ids (default: the fixture's reference.json prompt)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--drafts", default="0")
    ap.add_argument("--mode", default="fixed", choices=["fixed", "adaptive"])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--seed", type=int, default=1, help="sampling seed (the same for every run)")
    ap.add_argument("--sampling", default="", help="more generate flags, e.g. \"--top-p 0.95 --top-k 50\"")
    ap.add_argument("--out", help="result file (default bench/results/<date>-cpu-decode-<model>.json)")
    args = ap.parse_args()

    ids = args.ids
    if not ids:
        ids = ",".join(map(str, json.load(open(os.path.join(args.model, "reference.json")))["prompt_ids"]))
    sampling = ["--temperature", str(args.temperature), "--seed", str(args.seed)] + shlex.split(args.sampling)
    runs = []
    for threads in map(int, args.threads.split(",")):
        for drafts in map(int, args.drafts.split(",")):
            best = None
            for _ in range(args.repeat):
                r = run_once(args.binary, args.model, ids, args.tokens, threads, drafts, args.mode, sampling)
                if best is None or r["decode_tok_s"] > best["decode_tok_s"]:
                    best = r
            best.update(threads=threads, drafts=drafts, mode=args.mode, temperature=args.temperature,
                        seed=args.seed, sampling=args.sampling)
            print(f"threads {threads} drafts {drafts}: decode {best['decode_tok_s']:.1f} tok/s, "
                  f"prefill {best['prefill_tok_s']:.1f} tok/s"
                  + (f", {best['tokens_per_step']:.2f} tokens/step" if "tokens_per_step" in best else ""))
            runs.append(best)
    outputs = {json.dumps(r.pop("ids")) for r in runs}
    date = datetime.date.today().isoformat()
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    result = {"date": date, "cpu": cpu_name(), "cores": os.cpu_count(), "commit": commit,
              "model": os.path.relpath(os.path.abspath(args.model), ROOT), "prompt_tokens": len(ids.split(",")),
              "generated_tokens": args.tokens, "repeat_best_of": args.repeat,
              "identical_outputs_across_settings": len(outputs) == 1, "runs": runs}
    suffix = f"-t{args.temperature:g}" if args.temperature > 0 else ""
    name = args.out or os.path.join(ROOT, "bench", "results",
                                    f"{date}-cpu-decode-{os.path.basename(os.path.normpath(args.model))}{suffix}.json")
    with open(name, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print("wrote", os.path.relpath(name, ROOT))
    return 0 if len(outputs) == 1 or args.temperature > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
