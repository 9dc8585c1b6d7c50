#!/usr/bin/env python3
"""A large synthetic qwen4_exp checkpoint for benchmarks (pack and load throughput), not for accuracy.

Real Flash-Next tensor shapes (hidden 2560, experts [640 x 2560], vocabulary 248320, ...) taken from the
released config.json, but fewer layers and, optionally, fewer experts per layer, so the checkpoint is a few GB.
Weights are bf16 drawn from N(0, 0.02) (one random pool reused at random offsets, so writing is disk-bound),
saved as HF sharded safetensors with experts fused per layer (gate_up_proj / down_proj), as transformers does.
Includes a PLE layer (small n-gram table in four shards) and the MTP head.

    python3 tools/make_synthetic_checkpoint.py --config /work/shared/data/flash-next/config.json \\
        --layers 2 --experts 128 --out /tmp/synthetic-flash-next
"""
import argparse
import json
import os
import shutil

import numpy as np

SHARD_BYTES = 2 << 30
POOL_VALUES = 1 << 25


def bf16_pool(rng: np.random.Generator) -> np.ndarray:
    values = (rng.standard_normal(POOL_VALUES, dtype=np.float32) * 0.02).view(np.uint32)
    return ((values + 0x7FFF + ((values >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even


def layer_tensors(prefix: str, c: dict, kind: str, ple: bool) -> list:
    h, s, r = c["hidden_size"], c["hc_count"], c["hc_lowrank"]
    sh, e, inner = s * h, c["num_experts"], c["moe_intermediate_size"]
    t = []
    for hc in ("attn_hyper_connection.", "mlp_hyper_connection."):
        t += [(hc + "hc_norm.weight", [sh]), (hc + "input_mix_weight_down.weight", [r, sh]),
              (hc + "input_mix_weight_up.weight", [sh, r]), (hc + "block_inject_weight.weight", [s, sh])]
    if kind == "linear_attention":
        kd = c["linear_num_key_heads"] * c["linear_key_head_dim"]
        vh, vd = c["linear_num_value_heads"], c["linear_value_head_dim"]
        conv = 2 * kd + vh * vd
        t += [("linear_attn.in_proj_qkv.weight", [conv, h]), ("linear_attn.in_proj_z.weight", [vh * vd, h]),
              ("linear_attn.in_proj_b.weight", [vh, h]), ("linear_attn.in_proj_a.weight", [vh, h]),
              ("linear_attn.out_proj.weight", [h, vh * vd]),
              ("linear_attn.conv1d.weight", [conv, 1, c["linear_conv_kernel_dim"]]),
              ("linear_attn.A_log", [vh]), ("linear_attn.dt_bias", [vh]), ("linear_attn.norm.weight", [vd])]
    else:
        hd, heads, kv, ihd = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"], c["indexer_head_dim"]
        t += [("self_attn.q_proj.weight", [heads * hd * 2, h]), ("self_attn.k_proj.weight", [kv * hd, h]),
              ("self_attn.v_proj.weight", [kv * hd, h]), ("self_attn.o_proj.weight", [h, heads * hd]),
              ("self_attn.q_norm.weight", [hd]), ("self_attn.k_norm.weight", [hd]),
              ("self_attn.indexer.index_qk_proj.weight", [(c["indexer_n_heads"] + 1) * ihd, h]),
              ("self_attn.indexer.q_layernorm.weight", [ihd]), ("self_attn.indexer.k_layernorm.weight", [ihd])]
    shared = c["shared_expert_intermediate_size"]
    t += [("mlp.gate.weight", [e, h]), ("mlp.experts.gate_up_proj", [e, 2 * inner, h]),
          ("mlp.experts.down_proj", [e, h, inner]), ("mlp.shared_expert.gate_proj.weight", [shared, h]),
          ("mlp.shared_expert.up_proj.weight", [shared, h]), ("mlp.shared_expert.down_proj.weight", [h, shared]),
          ("mlp.shared_expert_gate.weight", [1, h])]
    if ple:
        heads = (c["ngram_size"] - 1) * c["heads_per_ngram"]
        width, pe = c["ple_embed_dim"] // heads, c["ple_embed_dim"]
        rows = heads * 4096
        t += [("ple.ple_embedding.ngram_embedding.shard_%d.weight" % k, [rows // 4, width]) for k in range(4)]
        t += [("ple.key_proj.weight", [sh, pe]), ("ple.value_proj.weight", [h, pe]),
              ("ple.norm_key.weight", [sh]), ("ple.norm_query.weight", [sh]), ("ple.norm_conv.weight", [sh]),
              ("ple.conv1d.weight", [sh, 1, c["ple_conv_kernel_size"]])]
        ints = {"ple.ple_embedding.layer_multipliers": np.arange(1, c["ngram_size"] + 1, dtype=np.int64) * 7919,
                "ple.ple_embedding.ngram_heads_vocab_sizes": np.full(heads, 4096, dtype=np.int64),
                "ple.ple_embedding.ngram_heads_offsets": np.arange(heads, dtype=np.int64) * 4096}
        t += [(name, values) for name, values in ints.items()]
    return [(prefix + name, shape) for name, shape in t]


def all_tensors(c: dict) -> list:
    h, sh = c["hidden_size"], c["hc_count"] * c["hidden_size"]
    ple = {i - 1 for i in c.get("ple_layer_ids", [])}
    t = [("model.embed_tokens.weight", [c["vocab_size"], h]), ("lm_head.weight", [c["vocab_size"], h])]
    for i, kind in enumerate(c["layer_types"]):
        t += layer_tensors("model.layers.%d." % i, c, kind, i in ple)
    mixer = [("hc_norm.weight", [sh]), ("input_mix_weight_down.weight", [c["hc_lowrank"], sh]),
             ("input_mix_weight_up.weight", [sh, c["hc_lowrank"]])]
    t += [("model.hyper_connection_mixer." + n, s) for n, s in mixer]
    t += [("mtp.pre_fc_norm_embedding.weight", [h]), ("mtp.pre_fc_norm_hidden.weight", [sh]),
          ("mtp.fc_embedding.weight", [h, h]), ("mtp.fc_hidden.weight", [h, h])]
    t += layer_tensors("mtp.layers.0.", c, "qwen_sparse_attention", False)
    t += [("mtp.hyper_connection_mixer." + n, s) for n, s in mixer]
    return t


def tensor_bytes(shape_or_values) -> int:
    if isinstance(shape_or_values, np.ndarray):
        return shape_or_values.nbytes
    return int(np.prod(shape_or_values)) * 2


def write_shard(path: str, tensors: list, pool: np.ndarray, rng: np.random.Generator) -> None:
    header, offset = {}, 0
    for name, spec in tensors:
        n = tensor_bytes(spec)
        if isinstance(spec, np.ndarray):
            header[name] = {"dtype": "I64", "shape": list(spec.shape), "data_offsets": [offset, offset + n]}
        else:
            header[name] = {"dtype": "BF16", "shape": spec, "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for name, spec in tensors:
            if isinstance(spec, np.ndarray):
                f.write(spec.tobytes())
                continue
            left = int(np.prod(spec))
            while left:
                start = int(rng.integers(0, POOL_VALUES // 2))
                take = min(left, POOL_VALUES - start)
                f.write(pool[start:start + take].tobytes())
                left -= take


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="the released Flash-Next config.json")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (GDN and sparse attention alternate)")
    ap.add_argument("--experts", type=int, default=128, help="routed experts per layer")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    with open(args.config) as f:
        c = json.load(f)
    kinds = ["linear_attention", "qwen_sparse_attention"]
    c["num_hidden_layers"] = args.layers
    c["layer_types"] = [kinds[i % 2] for i in range(args.layers)]
    c["num_experts"] = args.experts
    c["num_experts_per_tok"] = min(c["num_experts_per_tok"], args.experts)
    c["ple_layer_ids"] = [1]
    c["architectures"] = ["Qwen4ExpForCausalLM"]
    c["dtype"] = "bfloat16"

    if os.path.exists(args.out):
        shutil.rmtree(args.out)
    os.makedirs(args.out)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(c, f, indent=2)

    rng = np.random.default_rng(args.seed)
    pool = bf16_pool(rng)
    shards, current, size = [], [], 0
    for name, spec in all_tensors(c):
        n = tensor_bytes(spec)
        if current and size + n > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append((name, spec))
        size += n
    shards.append(current)
    weight_map, total = {}, 0
    for i, tensors in enumerate(shards):
        file = "model-%05d-of-%05d.safetensors" % (i + 1, len(shards))
        write_shard(os.path.join(args.out, file), tensors, pool, rng)
        for name, spec in tensors:
            weight_map[name] = file
            total += tensor_bytes(spec)
    with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    print("%s: %d tensors, %.2f GB in %d shards" % (args.out, len(weight_map), total / 1e9, len(shards)))


if __name__ == "__main__":
    main()
