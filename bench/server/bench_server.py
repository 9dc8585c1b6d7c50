#!/usr/bin/env python3
"""Throughput and latency of `vavilov serve` on the CPU at several numbers of concurrent streams.

Starts the server (on loopback, --parallel = the largest concurrency), then for each concurrency C runs C clients
that each stream R chat completions back to back (greedy, EOS suppressed so every request makes --max-tokens).
Reports aggregate generated tokens/s and p50/p99 time to first token, and writes a results JSON with the date, CPU,
commit and settings.

Usage: bench_server.py --binary build/vavilov [--model DIR] [--concurrency 1 4 16] [--out results.json]
Without --model it uses the MTP test fixture with a generated tokenizer (tests/server/make_test_model.py).
"""
import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "server"))

import harness  # noqa: E402
import openai  # noqa: E402

NO_EOS = {"0": -100, "1": -100}  # every request makes --max-tokens (the fixture's EOS ids; see stop_bias)


def stop_bias(model_dir):
    """-100 on every stop id of the model (config and generation_config), so requests make --max-tokens."""
    ids = set()
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(model_dir, name)
        if os.path.exists(path):
            config = json.load(open(path))
            value = config.get("eos_token_id", config.get("text_config", {}).get("eos_token_id"))
            ids.update(value if isinstance(value, list) else [] if value is None else [value])
    return {str(i): -100 for i in ids}


def cpu_name():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def one_request(client, i, max_tokens):
    started = time.monotonic()
    first = None
    tokens = 0
    stream = client.chat.completions.create(
        model=harness.MODEL_NAME, temperature=0, max_tokens=max_tokens, logit_bias=NO_EOS, stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": f"Client request {i}: describe the quick brown fox."}])
    for chunk in stream:
        if first is None and any(c.delta.content for c in chunk.choices):
            first = time.monotonic() - started
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return first if first is not None else time.monotonic() - started, tokens


def percentile(values, p):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def run_level(client, concurrency, rounds, max_tokens):
    def worker(c):
        return [one_request(client, c * rounds + r, max_tokens) for r in range(rounds)]

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = [x for part in pool.map(worker, range(concurrency)) for x in part]
    elapsed = time.monotonic() - started
    ttft = [r[0] for r in results]
    tokens = sum(r[1] for r in results)
    return {"concurrency": concurrency, "requests": len(results), "generated_tokens": tokens,
            "seconds": round(elapsed, 3), "tokens_per_second": round(tokens / elapsed, 1),
            "ttft_p50_ms": round(1000 * statistics.median(ttft), 1),
            "ttft_p99_ms": round(1000 * percentile(ttft, 99), 1)}


def gpu_name():
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--binary", required=True)
    parser.add_argument("--model")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=4, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=0, help="server CPU threads (0: all)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="the server's --device")
    parser.add_argument("--out", default=os.path.join(HERE, "results.json"))
    args = parser.parse_args()
    os.environ["VAVILOV_BINARY"] = os.path.abspath(args.binary)
    if args.model:
        harness._model_dir = os.path.abspath(args.model)
        NO_EOS.clear()
        NO_EOS.update(stop_bias(args.model))
    parallel = max(args.concurrency)
    extra = ["--parallel", str(parallel), "--queue", str(parallel), "--cache-mb", "0", "--device", args.device]
    os.environ["VAVILOV_TEST_THREADS"] = str(args.threads)
    server = harness.Server(*extra)
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=600)
        one_request(client, -1, 4)  # warm-up
        levels = []
        for concurrency in args.concurrency:
            levels.append(run_level(client, concurrency, args.rounds, args.max_tokens))
            print(json.dumps(levels[-1]), flush=True)
        spec = {"proposed": server.metric("vavilov_spec_drafts_proposed_total"),
                "accepted": server.metric("vavilov_spec_drafts_accepted_total")}
    finally:
        server.stop()
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "cpu": cpu_name(), "cores": os.cpu_count(), "commit": commit, "device": args.device,
              "gpu": gpu_name() if args.device == "cuda" else None,
              "model": os.path.basename(harness.model_dir()) if args.model else "tests/fixtures/models_mtp/mtp_f32_hc4",
              "server_args": extra, "max_tokens": args.max_tokens, "rounds_per_client": args.rounds,
              "speculative_drafts": spec, "levels": levels,
              "note": "client and server share the machine; with the tiny fixture model this measures the server "
                      "and scheduler (HTTP, SSE, batching), not model math"}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
