#!/usr/bin/env python3
"""A tiny qwen4_exp checkpoint in MLX's affine format (as the released 4-bit conversion is laid out), and the logits
of HF transformers run on its dequantized weights.

Usage:
    python3 tools/make_mlx_model_fixture.py --out tests/fixtures/models_mlx

Writes OUT/tiny_mlx_q4/ with
  config.json         qwen4_exp with text_config, plus `quantization` (= `quantization_config`): default 4 bits,
                      group 64, and per-module overrides: routers and shared-expert gates at 8 bits (mlx-vlm's
                      predicate) except layer 2's router, left BF16 (`false`, as in Cherenkov's checkpoint); layer 0's
                      experts' down_proj at 2 bits and layer 1's gate_proj at 3 bits (mixed precision); the n-gram
                      table shards at group 32
  model.safetensors   written by mlx.core.save_safetensors: language_model.model.* and language_model.lm_head.*,
                      experts stacked per layer as mlp.switch_mlp.{gate,up,down}_proj, n-gram table as
                      ngram_embedding.shards.K, conv1d taps as [C, K, 1], zero-centred RMSNorm weights stored shifted
                      (1 + w) except the GDN output norm (see docs/FORMATS.md); every .weight of a quantized module is
                      uint32 codes with bf16 .scales and .biases made by mx.quantize from the bf16 weights
  logits.f32          HF fp32 logits [prompt, vocab] of the model whose weights are exactly what the checkpoint holds
                      (mx.dequantize of the codes, bf16 dense tensors widened, norms shifted back in fp32)
  logits_experts3.f32 the same with every routed expert re-quantized to 3 bits from its dequantized values by
  logits_experts2.f32 mx.quantize (scales and biases then rounded to bf16, as the engine stores them), for --experts
  reference.json      prompt ids, greedy continuation, the quantization layout, fragility margins, versions

The random model comes from tools/make_fixtures.py's rules (randomize, lm_head calibration), BF16 like the
release; attempts with near-ties (greedy margin, router gap, indexer gap) are rejected as there.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import random
import shutil
import sys

import mlx.core as mx
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402

NAME = "tiny_mlx_q4"
L, S = mf.L, mf.S
CFG = dict(vocab_size=256, hidden_size=64, layer_types=[L, L, S, L],
           num_attention_heads=4, num_key_value_heads=1, head_dim=16, partial_rotary_factor=0.5,
           indexer_n_heads=2, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
           linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
           num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
           hc_count=2, hc_lowrank=64, ple_layer_ids=[2], ple_embed_dim=512, ngram_vocab_size_base=300,
           split_ngram_parts=2, eos_token_id=1, output_gate_type="sigmoid")
PROMPT_LEN, EOS_POSITIONS = 40, [12, 13]
TABLE_SHARDS = 2
DEFAULT = {"group_size": 64, "bits": 4, "mode": "affine"}
SHIFTED_NORMS = ("hc_norm.weight", "q_norm.weight", "k_norm.weight", "q_layernorm.weight", "k_layernorm.weight",
                 "norm_key.weight", "norm_query.weight", "norm_conv.weight")


def overrides() -> dict:
    out = {}
    for layer in range(len(CFG["layer_types"])):
        p = f"language_model.model.layers.{layer}.mlp"
        out[f"{p}.gate"] = False if layer == 2 else {"group_size": 64, "bits": 8, "mode": "affine"}
        out[f"{p}.shared_expert_gate"] = {"group_size": 64, "bits": 8, "mode": "affine"}
    out["language_model.model.layers.0.mlp.switch_mlp.down_proj"] = {"group_size": 64, "bits": 2, "mode": "affine"}
    out["language_model.model.layers.1.mlp.switch_mlp.gate_proj"] = {"group_size": 64, "bits": 3, "mode": "affine"}
    for k in range(TABLE_SHARDS):
        out[f"language_model.model.layers.1.ple.ple_embedding.ngram_embedding.shards.{k}"] = {
            "group_size": 32, "bits": 4, "mode": "affine"}
    return out


def mlx_tensors(model) -> dict[str, torch.Tensor]:
    """HF parameters (bf16-valued fp32) under mlx-lm/mlx-vlm names, still dense."""
    out = {}
    for name, p in model.named_parameters():
        p = p.detach().clone()
        mlx_name = "language_model." + name
        if name.endswith("mlp.experts.gate_up_proj"):
            inner = p.shape[1] // 2
            base = mlx_name.replace("experts.gate_up_proj", "switch_mlp.")
            out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = p[:, :inner], p[:, inner:]
        elif name.endswith("mlp.experts.down_proj"):
            out[mlx_name.replace("experts.down_proj", "switch_mlp.down_proj.weight")] = p
        elif name.endswith("ngram_embedding.weight"):
            for k, shard in enumerate(p.chunk(TABLE_SHARDS, 0)):
                out[mlx_name.replace("ngram_embedding.weight", f"ngram_embedding.shards.{k}.weight")] = shard
        elif name.endswith("conv1d.weight"):
            out[mlx_name] = p.movedim(2, 1)  # [C, 1, K] -> [C, K, 1], as mlx-vlm's sanitize stores it
        elif name.endswith(SHIFTED_NORMS):
            out[mlx_name] = p + 1.0
        else:
            out[mlx_name] = p
    return out


def to_mx(t: torch.Tensor) -> mx.array:
    return mx.array(t.float().numpy()).astype(mx.bfloat16)


def to_torch(a: mx.array) -> torch.Tensor:
    return torch.from_numpy(np.array(a.astype(mx.float32)))


def quantize_all(dense: dict[str, torch.Tensor], quant: dict):
    """MLX arrays to save, and the fp32 values the checkpoint stands for (what HF must run on)."""
    saved, values = {}, {}
    for name, t in dense.items():
        a = to_mx(t)
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        spec = quant.get(module, DEFAULT) if module else None
        quantizable = module is not None and a.ndim >= 2 and spec is not False
        if quantizable and a.shape[-1] % spec["group_size"] == 0:
            q, s, b = mx.quantize(a, group_size=spec["group_size"], bits=spec["bits"])
            saved[name], saved[module + ".scales"], saved[module + ".biases"] = q, s, b
            values[name] = to_torch(mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32),
                                                  group_size=spec["group_size"], bits=spec["bits"]))
        else:
            saved[name] = a
            values[name] = to_torch(a)
        if name.endswith(SHIFTED_NORMS):
            values[name] = values[name] - 1.0  # exact in fp32: what the engine recovers from the stored bf16(1 + w)
    return saved, values


def requantize_experts(values: dict[str, torch.Tensor], quant: dict, bits: int) -> dict[str, torch.Tensor]:
    """Every routed expert projection re-quantized to `bits` from its dequantized values, as --experts does; one
    already stored at `bits` (group 64) keeps its values."""
    out = dict(values)
    for name, v in values.items():
        if ".switch_mlp." not in name or quant.get(name[: -len(".weight")], DEFAULT)["bits"] == bits:
            continue
        q, s, b = mx.quantize(mx.array(v.numpy()), group_size=64, bits=bits)
        s32, b32 = s.astype(mx.bfloat16).astype(mx.float32), b.astype(mx.bfloat16).astype(mx.float32)
        out[name] = to_torch(mx.dequantize(q, s32, b32, group_size=64, bits=bits))
    return out


@torch.no_grad()
def load_values(model, values: dict[str, torch.Tensor]):
    """Puts MLX-named fp32 values back into the HF model."""
    for name, p in model.named_parameters():
        mlx_name = "language_model." + name
        if name.endswith("mlp.experts.gate_up_proj"):
            base = mlx_name.replace("experts.gate_up_proj", "switch_mlp.")
            v = torch.cat([values[base + "gate_proj.weight"], values[base + "up_proj.weight"]], 1)
        elif name.endswith("mlp.experts.down_proj"):
            v = values[mlx_name.replace("experts.down_proj", "switch_mlp.down_proj.weight")]
        elif name.endswith("ngram_embedding.weight"):
            v = torch.cat([values[mlx_name.replace("ngram_embedding.weight", f"ngram_embedding.shards.{k}.weight")]
                           for k in range(TABLE_SHARDS)], 0)
        elif name.endswith("conv1d.weight"):
            v = values[mlx_name].movedim(1, 2)
        else:
            v = values[mlx_name]
        assert tuple(v.shape) == tuple(p.shape), (name, v.shape, p.shape)
        p.copy_(v)


def text_config_dict(cfg) -> dict:
    d = cfg.to_dict()
    d["model_type"] = "qwen4_exp_text"
    return d


def attempt(seed: int, number: int):
    cfg = mf.build_config(CFG)
    aseed = mf.stable_seed(seed, NAME, number)
    torch.manual_seed(aseed)
    model = mf.Qwen4ExpForCausalLM(copy.deepcopy(cfg)).eval()
    mf.randomize(model, torch.Generator().manual_seed(aseed))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    prompt = mf.make_prompt(random.Random(aseed), cfg.vocab_size, 1, PROMPT_LEN, EOS_POSITIONS)
    lg = mf.logits_oneshot(model, prompt)
    with torch.no_grad():
        model.lm_head.weight.mul_(mf.LOGIT_STD_TARGET / float(lg.std()))
        model.lm_head.weight.copy_(model.lm_head.weight.to(torch.bfloat16).float())
    quant = overrides()
    saved, values = quantize_all(mlx_tensors(model), quant)
    params = {name for name, _ in model.named_parameters()}
    for name, buffer in model.state_dict().items():  # the PLE hash's int64 tables
        if name not in params:
            saved["language_model." + name] = mx.array(buffer.numpy())
    load_values(model, values)
    probes = mf.Probes(model)
    ref = mf.logits_oneshot(model, prompt)
    gen, margins = mf.greedy(model, prompt, mf.N_GREEDY)
    probes.close()
    variants = {}
    for bits in (3, 2):
        load_values(model, requantize_experts(values, quant, bits))
        probes_low = mf.Probes(model)
        variants[bits] = mf.logits_oneshot(model, prompt)
        probes_low.close()
        probes.router_gap = min(probes.router_gap, probes_low.router_gap)
        probes.indexer_gap = min(probes.indexer_gap, probes_low.indexer_gap)
    fragile = (min(margins) < mf.GREEDY_MARGIN_MIN or probes.router_gap < mf.ROUTER_GAP_MIN
               or probes.indexer_gap < mf.INDEXER_GAP_MIN)
    return cfg, quant, saved, prompt, ref, gen, margins, probes, variants, aseed, fragile


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()
    mx.set_default_device(mx.cpu)
    torch.set_num_threads(1)
    for number in range(25):
        cfg, quant, saved, prompt, ref, gen, margins, probes, variants, aseed, fragile = attempt(args.seed, number)
        if not fragile:
            break
        print(f"attempt {number} rejected: near-tie (margin {min(margins):.1e}, router gap {probes.router_gap:.1e}, "
              f"indexer gap {probes.indexer_gap:.1e})", flush=True)
    else:
        raise SystemExit("no robust fixture after 25 attempts")

    out_dir = os.path.join(args.out, NAME)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    quantization = dict(DEFAULT, **quant)
    config = {"architectures": ["Qwen4ExpForConditionalGeneration"], "model_type": "qwen4_exp",
              "tie_word_embeddings": False, "text_config": text_config_dict(cfg),
              "quantization": quantization, "quantization_config": quantization}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    mx.save_safetensors(os.path.join(out_dir, "model.safetensors"), saved, metadata={"format": "mlx"})
    ref.numpy().astype("<f4").tofile(os.path.join(out_dir, "logits.f32"))
    for bits, logits in variants.items():
        logits.numpy().astype("<f4").tofile(os.path.join(out_dir, f"logits_experts{bits}.f32"))
    reference = {
        "prompt_ids": prompt, "greedy_ids": gen, "vocab_size": cfg.vocab_size, "logits_file": "logits.f32",
        "experts_logits_files": {str(b): f"logits_experts{b}.f32" for b in variants},
        "min_greedy_margin": min(margins), "min_router_gap": probes.router_gap,
        "min_indexer_gap": probes.indexer_gap, "logits_std": float(ref.std()),
        "generator": {"tool": "tools/make_mlx_model_fixture.py", "seed": args.seed, "attempt_seed": aseed,
                      "mlx": mx.__version__, "transformers": mf.transformers.__version__,
                      "torch": torch.__version__.split("+")[0]},
    }
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        f.write(mf.dump_json(reference))
    size = sum(os.path.getsize(os.path.join(out_dir, n)) for n in os.listdir(out_dir))
    print(f"[{NAME}] {size / 1e6:.2f} MB, greedy margin {min(margins):.2e}, router gap {probes.router_gap:.2e}, "
          f"indexer gap {probes.indexer_gap:.2e}, logits std {float(ref.std()):.2f}")


if __name__ == "__main__":
    main()
