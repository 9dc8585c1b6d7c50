#!/usr/bin/env python3
"""A tiny qwen4_exp checkpoint in NVIDIA ModelOpt's NVFP4 export layout, and the logits of HF transformers run on its
dequantized weights.

Usage:
    python3 tools/make_nvfp4_fixture.py --out tests/fixtures/models_nvfp4

Writes OUT/tiny_nvfp4/ (HF per-expert names, as save_pretrained writes them) with
  routed experts  mlp.experts.E.{gate,up,down}_proj: NVFP4 — .weight uint8 [out, in/2] (two e2m1 codes a byte, the
                  even column in the low nibble), .weight_scale float8_e4m3fn [out, in/16], .weight_scale_2 float32
                  [] (per tensor), .input_scale float32 [] (activation scale; weight-only engines ignore it)
  shared experts  FP8 E4M3 per tensor — .weight float8_e4m3fn, .weight_scale float32 [], .input_scale float32 []
  everything else BF16
  hf_quant_config.json   ModelOpt's MIXED_PRECISION form (quantized_layers: NVFP4 group 16 / FP8 per module), and
                         config.json's quantization_config (quant_method modelopt)
  logits.f32, reference.json   HF fp32 logits of the model whose weights are exactly the dequantized ones:
                         NVFP4 w = e2m1 · e4m3 block scale · weight_scale_2, FP8 w = e4m3 · weight_scale.

The quantization follows ModelOpt's documented arithmetic (NVFP4QTensor): weight_scale_2 = amax(|W|)/(6·448); per
block of 16, scale = amax(block)/(6·weight_scale_2) cast to e4m3 (zero scales become 1); codes = the nearest e2m1
value of W/(scale·weight_scale_2); FP8: weight_scale = amax(|W|)/448, codes = e4m3(W/weight_scale).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import random
import shutil
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402
from make_mlx_model_fixture import CFG  # noqa: E402  (every width a multiple of 16)

NAME = "tiny_nvfp4"
PROMPT_LEN, EOS_POSITIONS = 40, [9, 10]
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FP8_MAX, FP4_MAX = 448.0, 6.0


def nvfp4(w: torch.Tensor):
    """ModelOpt NVFP4 of a 2-D fp32 weight: packed codes, e4m3 block scales, fp32 tensor scale; and w dequantized."""
    out_dim, in_dim = w.shape
    scale_2 = w.abs().max() / (FP4_MAX * FP8_MAX)
    blocks = w.reshape(out_dim, in_dim // 16, 16)
    block_scale = (blocks.abs().amax(-1) / (FP4_MAX * scale_2)).clamp(max=FP8_MAX).to(torch.float8_e4m3fn).float()
    block_scale = torch.where(block_scale == 0, 1.0, block_scale).to(torch.float8_e4m3fn)
    scaled = blocks / (block_scale.float()[..., None] * scale_2)
    magnitude = (scaled.abs()[..., None] - E2M1).abs().argmin(-1)  # index of the nearest e2m1 magnitude
    codes = (magnitude | ((scaled < 0) & (magnitude > 0)).long() << 3).reshape(out_dim, in_dim).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    values = E2M1[magnitude] * torch.where(scaled < 0, -1.0, 1.0)
    deq = (values * block_scale.float()[..., None] * scale_2).reshape(out_dim, in_dim)
    # Self-check: the packed bytes decode (independently of the quantizer's intermediate values) to `deq`.
    unpacked = torch.stack([packed & 0xF, packed >> 4], -1).reshape(out_dim, in_dim).long()
    decoded = E2M1[unpacked & 7] * torch.where(unpacked >= 8, -1.0, 1.0)
    assert torch.equal(decoded.reshape(out_dim, in_dim // 16, 16) * block_scale.float()[..., None] * scale_2,
                       deq.reshape(out_dim, in_dim // 16, 16))
    return packed.contiguous(), block_scale.contiguous(), scale_2.reshape(()).float(), deq


def fp8(w: torch.Tensor):
    scale = w.abs().max() / FP8_MAX
    codes = (w / scale).to(torch.float8_e4m3fn)
    return codes.contiguous(), scale.reshape(()).float(), codes.float() * scale


def quantize_checkpoint(tensors: dict[str, torch.Tensor]):
    """The export's tensors, the dequantized values by HF name, and the quantized_layers map."""
    saved, values, layers = {}, {}, {}
    for name, t in tensors.items():
        module = name[: -len(".weight")]
        if ".mlp.experts." in name and name.endswith("_proj.weight"):
            packed, block_scale, scale_2, deq = nvfp4(t.float())
            saved[name], saved[module + ".weight_scale"], saved[module + ".weight_scale_2"] = packed, block_scale, scale_2
            saved[module + ".input_scale"] = torch.tensor(0.05)
            values[name] = deq
            layers[module] = {"quant_algo": "NVFP4", "group_size": 16}
        elif ".mlp.shared_expert." in name and name.endswith("_proj.weight"):
            codes, scale, deq = fp8(t.float())
            saved[name], saved[module + ".weight_scale"] = codes, scale
            saved[module + ".input_scale"] = torch.tensor(0.05)
            values[name] = deq
            layers[module] = {"quant_algo": "FP8"}
        else:
            saved[name] = t
            values[name] = t.float() if t.is_floating_point() else t
    return saved, values, layers


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=13)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = mf.build_config(CFG)
    for number in range(25):
        aseed = mf.stable_seed(args.seed, NAME, number)
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
        tmp = tempfile.mkdtemp(prefix="nvfp4_")
        mf.save_checkpoint(model, {"layout": "per_expert"}, tmp, torch.bfloat16)
        saved, values, layers = quantize_checkpoint(load_file(os.path.join(tmp, "model.safetensors")))
        # HF reads the dequantized values back through from_pretrained (it fuses the per-expert tensors itself).
        dequantized = tempfile.mkdtemp(prefix="nvfp4_values_")
        shutil.copy(os.path.join(tmp, "config.json"), dequantized)
        save_file(values, os.path.join(dequantized, "model.safetensors"), metadata={"format": "pt"})
        reference = mf.Qwen4ExpForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()
        shutil.rmtree(dequantized, ignore_errors=True)
        probes = mf.Probes(reference)
        ref = mf.logits_oneshot(reference, prompt)
        gen, margins = mf.greedy(reference, prompt, mf.N_GREEDY)
        probes.close()
        if min(margins) >= mf.GREEDY_MARGIN_MIN and probes.router_gap >= mf.ROUTER_GAP_MIN and \
                probes.indexer_gap >= mf.INDEXER_GAP_MIN:
            break
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"attempt {number} rejected: near-tie", flush=True)
    else:
        raise SystemExit("no robust fixture after 25 attempts")

    out_dir = os.path.join(args.out, NAME)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    quant = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "quantized_layers": layers}
    with open(os.path.join(out_dir, "hf_quant_config.json"), "w") as f:
        json.dump({"producer": {"name": "modelopt", "version": "tools/make_nvfp4_fixture.py"},
                   "quantization": quant}, f, indent=2)
    config = json.load(open(os.path.join(tmp, "config.json")))
    config["quantization_config"] = dict(quant, quant_method="modelopt")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(dict(sorted(saved.items())), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(tmp, ignore_errors=True)
    ref.numpy().astype("<f4").tofile(os.path.join(out_dir, "logits.f32"))
    info = {"prompt_ids": prompt, "greedy_ids": gen, "vocab_size": cfg.vocab_size, "logits_file": "logits.f32",
            "min_greedy_margin": min(margins), "min_router_gap": probes.router_gap,
            "min_indexer_gap": probes.indexer_gap, "logits_std": float(ref.std()),
            "generator": {"tool": "tools/make_nvfp4_fixture.py", "seed": args.seed, "attempt_seed": aseed,
                          "transformers": mf.transformers.__version__, "torch": torch.__version__.split("+")[0]}}
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        f.write(mf.dump_json(info))
    size = sum(os.path.getsize(os.path.join(out_dir, n)) for n in os.listdir(out_dir))
    print(f"[{NAME}] {size / 1e6:.2f} MB, greedy margin {min(margins):.2e}, router gap {probes.router_gap:.2e}, "
          f"indexer gap {probes.indexer_gap:.2e}")


if __name__ == "__main__":
    main()
