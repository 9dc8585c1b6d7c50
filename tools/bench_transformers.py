#!/usr/bin/env python3
"""HF transformers' own qwen4_exp at a config's geometry with fewer layers: prefill and decode speed on one GPU.

The side-by-side for issue 6: the same geometry, layer count and dtype that `vavilov bench --synthetic CONFIG
--layers N --weights bf16` runs, built with transformers' Qwen4ExpForCausalLM (random weights from HF's own
initialisation; speed does not depend on their values), in bf16, with its KV / recurrent cache. The n-gram (PLE)
table is shrunk to about `--ngram-rows` rows per head as vavilov's synthetic weights are (a token reads 16 rows
either way). No MTP head (ForCausalLM has none).

    python3 tools/bench_transformers.py --config models/configs/flash-next.json --layers 4 --out result.json

Measures, after one warm-up generation:
  prefill_tok_s: prompt tokens / the time of one forward over the prompt (logits of the last row only);
  decode_tok_s:  generated tokens / the time of greedy steps with the cache, i.e.
                 (time of generate(prompt, 1 + D new) − time of generate(prompt, 1 new)) / D.
Versions are pinned in tools/requirements.txt (torch 2.15.0, transformers 5.17.0).
"""
import argparse
import importlib.util
import json
import sys
import time

import torch
import transformers
from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

DROPPED_KEYS = ("transformers_version", "architectures", "model_type", "_name_or_path", "id2label", "label2id",
                "output_hidden_states", "return_dict", "dtype", "chunk_size_feed_forward", "is_encoder_decoder",
                "problem_type", "output_attentions")


def build_config(path: str, layers: int, ngram_rows: int, attn: str, experts: str) -> Qwen4ExpTextConfig:
    with open(path) as f:
        raw = json.load(f)
    raw = raw.get("text_config", raw)
    cfg = {k: v for k, v in raw.items() if k not in DROPPED_KEYS}
    if layers > len(cfg["layer_types"]):
        sys.exit(f"{path}: --layers {layers} is more than the config's {len(cfg['layer_types'])} layers")
    cfg["layer_types"] = cfg["layer_types"][:layers]
    cfg["num_hidden_layers"] = layers
    cfg["ple_layer_ids"] = [i for i in cfg.get("ple_layer_ids", []) if i < layers]
    cfg["ngram_vocab_size_base"] = ngram_rows
    cfg["mtp_num_hidden_layers"] = 0
    config = Qwen4ExpTextConfig(**cfg)
    config._attn_implementation = attn
    config._experts_implementation = experts
    return config


def timed(device: str, fn):
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="config.json (e.g. models/configs/flash-next.json)")
    p.add_argument("--layers", type=int, default=4, help="the first N layers of the config (default 4)")
    p.add_argument("--prefill", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("--decode", type=int, default=32, help="greedy tokens timed after the prompt (default 32)")
    p.add_argument("--ngram-rows", type=int, default=100003, help="n-gram table rows per head (default 100003)")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="attention implementation")
    p.add_argument("--experts", default="grouped_mm", choices=["grouped_mm", "batched_mm", "eager"],
                   help="transformers' experts implementation (default grouped_mm, its fastest for prefill)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="JSON output file (default: stdout)")
    a = p.parse_args()
    if a.layers < 1 or a.prefill < 1 or a.decode < 1:
        sys.exit("--layers, --prefill and --decode must be positive")
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device is available to torch")

    torch.manual_seed(a.seed)
    dtype = getattr(torch, a.dtype)
    config = build_config(a.config, a.layers, a.ngram_rows, a.attn, a.experts)
    with torch.device(a.device):
        model = Qwen4ExpForCausalLM._from_config(config, dtype=dtype).eval()
    parameters = sum(p.numel() for p in model.parameters())

    g = torch.Generator().manual_seed(a.seed)
    prompt = torch.randint(0, config.vocab_size, (1, a.prefill), generator=g).to(a.device)
    generate = dict(do_sample=False, use_cache=True, pad_token_id=0)

    def run(new_tokens: int):
        return model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **generate)

    run(2)  # warm-up: kernels, allocator, cache classes
    prefill_s, _ = timed(a.device, lambda: model(prompt, use_cache=True, logits_to_keep=1))
    one_s, _ = timed(a.device, lambda: run(1))
    many_s, out = timed(a.device, lambda: run(1 + a.decode))
    generated = out.shape[1] - prompt.shape[1] - 1
    result = {
        "engine": "transformers",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "gpu": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
        "config": a.config,
        "layers": a.layers,
        "dtype": a.dtype,
        "attn_implementation": a.attn,
        "experts_implementation": a.experts,
        "parameters": parameters,
        # Without these transformers runs its reference PyTorch GDN and conv code (it says so on stderr).
        "flash_linear_attention_installed": importlib.util.find_spec("fla") is not None,
        "causal_conv1d_installed": importlib.util.find_spec("causal_conv1d") is not None,
        "ngram_rows_per_head": a.ngram_rows,
        "prefill_tokens": a.prefill,
        "prefill_s": prefill_s,
        "prefill_tok_s": a.prefill / prefill_s,
        "decode_tokens": generated,
        "decode_step_ms": (many_s - one_s) / generated * 1e3,
        "decode_tok_s": generated / (many_s - one_s),
        "max_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if a.device == "cuda" else None,
    }
    text = json.dumps(result, indent=2)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
