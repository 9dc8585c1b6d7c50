#!/usr/bin/env python3
"""MTP draft acceptance and decode speed of `vavilov generate` on held-out prompts, per draft setting.

For each prompt in a JSONL file ({"prompt": text, "source": ..., "licence": ...}, held out from the bundled model's
training data) and each setting, runs greedy (or sampled, with --temperature) generation and aggregates accepted/
proposed drafts per position and tokens/s. Checks that greedy outputs are identical across settings. Writes a JSON
result with date, CPU, commit to bench/results/.
    python3 bench/mtp_acceptance.py [--model models/flash-next-mini] [--settings 0,1f,2f,3f,2a,3a] [--tokens 128]
        [--repeats 3]
On a shared machine other processes stretch some runs: with --repeats N every prompt runs N times per setting (the
settings interleaved, so drift hits all alike) and the fastest decode of each prompt counts.
"""
import argparse
import datetime
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from cpu_decode import cpu_name  # noqa: E402


def parse_setting(text):
    drafts = int(text[0])
    mode = "adaptive" if text.endswith("a") else "fixed"
    return drafts, mode


def run(binary, model, prompt_ids, tokens, threads, drafts, mode, sampling):
    cmd = [binary, "generate", "--model", model, "--ids", ",".join(map(str, prompt_ids)), "--max-tokens",
           str(tokens), "--threads", str(threads), "--drafts", str(drafts), "--draft-mode", mode, *sampling]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    decode = float(re.search(r"decode: \d+ tokens, ([\d.]+) tok/s", out.stderr).group(1))
    accepted = [(int(a), int(p)) for a, p in re.findall(r"d\d+: (\d+)/(\d+)", out.stderr)]
    steps = re.search(r"mtp: (\d+) verify steps", out.stderr)
    return {"ids": json.loads(out.stdout.splitlines()[0]), "decode_tok_s": decode, "accepted": accepted,
            "verify_steps": int(steps.group(1)) if steps else None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "flash-next-mini"))
    ap.add_argument("--binary", default=os.path.join(ROOT, "build", "vavilov"))
    ap.add_argument("--prompts", default=os.path.join(ROOT, "bench", "prompts", "heldout_code.jsonl"))
    ap.add_argument("--settings", default="0,1f,2f,3f,2a,3a", help="drafts and f(ixed)/a(daptive), comma-separated")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1, help="runs per prompt and setting; the fastest decode counts")
    ap.add_argument("--out")
    args = ap.parse_args()
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    prompts = [json.loads(line) for line in open(args.prompts)]
    sampling = [] if args.temperature == 0 else ["--temperature", str(args.temperature), "--seed", str(args.seed)]

    settings = [parse_setting(s) for s in args.settings.split(",")]
    encoded = [tokenizer.encode(prompt["prompt"]).ids for prompt in prompts]
    fastest = {}  # (setting index, prompt index) -> run with the shortest decode
    outputs = {}  # prompt index -> every greedy output seen
    for _ in range(args.repeats):
        for index, ids in enumerate(encoded):
            for s_index, (drafts, mode) in enumerate(settings):
                r = run(args.binary, args.model, ids, args.tokens, args.threads, drafts, mode, sampling)
                r["seconds"] = len(r["ids"]) / r["decode_tok_s"]
                outputs.setdefault(index, set()).add(json.dumps(r["ids"]))
                best = fastest.get((s_index, index))
                if best is None or r["seconds"] < best["seconds"]:
                    fastest[(s_index, index)] = r
    results = []
    for s_index, (drafts, mode) in enumerate(settings):
        proposed = [0] * drafts
        accepted = [0] * drafts
        seconds = generated = steps = 0
        for index in range(len(prompts)):
            r = fastest[(s_index, index)]
            generated += len(r["ids"])
            seconds += r["seconds"]
            steps += r["verify_steps"] or 0
            for j, (a, p) in enumerate(r["accepted"]):
                accepted[j] += a
                proposed[j] += p
        row = {"drafts": drafts, "mode": mode, "decode_tok_s": generated / seconds,
               "acceptance_per_position": [a / p if p else None for a, p in zip(accepted, proposed)],
               "accepted": accepted, "proposed": proposed,
               "tokens_per_step": generated / steps if steps else 1.0}
        results.append(row)
        print(f"drafts {drafts} {mode:8}: {row['decode_tok_s']:7.1f} tok/s, tokens/step {row['tokens_per_step']:.2f}, "
              f"acceptance {['%.2f' % x for x in row['acceptance_per_position']]}")
    identical = all(len(v) == 1 for v in outputs.values())
    baseline = next((r["decode_tok_s"] for r in results if r["drafts"] == 0), None)
    for r in results:
        r["speedup_vs_no_drafts"] = r["decode_tok_s"] / baseline if baseline else None
    date = datetime.date.today().isoformat()
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    result = {"date": date, "cpu": cpu_name(), "threads": args.threads, "commit": commit,
              "model": os.path.relpath(os.path.abspath(args.model), ROOT),
              "prompts": os.path.relpath(os.path.abspath(args.prompts), ROOT), "prompt_count": len(prompts),
              "generated_tokens_per_prompt": args.tokens, "temperature": args.temperature,
              "repeats_fastest_counts": args.repeats,
              "greedy_outputs_identical_across_settings": identical if args.temperature == 0 else None,
              "settings": results}
    suffix = "greedy" if args.temperature == 0 else f"t{args.temperature:g}"
    name = args.out or os.path.join(ROOT, "bench", "results", f"{date}-mtp-acceptance-cpu-{suffix}.json")
    with open(name, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print("wrote", os.path.relpath(name, ROOT), "| identical greedy outputs:", identical)
    return 0 if identical or args.temperature else 1


if __name__ == "__main__":
    sys.exit(main())
