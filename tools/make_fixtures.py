#!/usr/bin/env python3
"""Build tiny random qwen4_exp checkpoints with HF transformers' own Qwen4ExpForCausalLM and record reference outputs.

Usage:
    python3 tools/make_fixtures.py --out tests/fixtures/models            # the fixed, committed fixture set
    python3 tools/make_fixtures.py --random 8 --seed 7 --out /tmp/rnd     # K extra checkpoints with random shapes
    python3 tools/make_fixtures.py --out DIR --only tiny_bf16_hc4         # rebuild one fixture

Each fixture directory holds an HF model directory (config.json + safetensors, possibly sharded / VL-prefixed /
fused-experts, see FIXTURES below), reference.json, logits.f32 (and logits_native.f32 for bf16).
See tests/fixtures/models/README.md for the format.

Everything is deterministic from --seed (CPU only, single thread for bit-stability).  A fixture is rejected and
regenerated with the next attempt seed when it is fragile: a greedy top-1/top-2 margin < 1e-3, an MoE router
top-k boundary gap < 1e-4, or a QSA indexer block-selection boundary gap < 1e-4 (near-ties that an engine with
slightly different rounding could resolve differently).

Self-checks performed for every fixture (the script aborts on failure):
  * every floating-point tensor in the saved checkpoint is non-constant (no HF zero/one init left);
  * chunked HF forward with the cache (chunks of 5 and 1) reproduces the one-shot logits (rel. 1e-5), which
    validates the cache path used for greedy_ids (observed 1e-7..3e-5: HF's
    chunked GDN kernel rounds differently for different chunk boundaries);
  * a one-shot forward over prompt + continuation reproduces the greedy ids;
  * the saved directory, reloaded with from_pretrained (or, for layouts HF cannot load, by hand), reproduces the
    reference logits (to 1e-5 relative; not bit-exact: from_pretrained keeps the tensors
    mmapped at unaligned addresses, so CPU kernels take other SIMD paths, ~1e-6 noise);
  * the QSA indexer really prunes (some query attends to fewer keys than are visible).
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
import warnings

import numpy as np
import torch

torch.set_num_threads(1)
warnings.filterwarnings("ignore")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig  # noqa: E402
from transformers.models.qwen4_exp import modeling_qwen4_exp as mq  # noqa: E402

transformers.logging.set_verbosity_error()
try:
    transformers.utils.logging.disable_progress_bar()
except Exception:  # pragma: no cover
    pass

N_GREEDY = 24
GREEDY_MARGIN_MIN = 1e-3
ROUTER_GAP_MIN = 1e-4
INDEXER_GAP_MIN = 1e-4
CHUNK_REL_TOL = 5e-5
RELOAD_REL_TOL = 1e-5  # from_pretrained mmaps unaligned tensors -> other SIMD paths, ~1e-6 noise
MAX_FIXTURE_BYTES = 1_500_000
LOGIT_STD_TARGET = 3.0

L, S = "linear_attention", "qwen_sparse_attention"

# ----------------------------------------------------------------------------------------------------------------
# The fixed fixture set.  "cfg" goes to Qwen4ExpTextConfig; the other keys describe prompt and on-disk layout.
# ----------------------------------------------------------------------------------------------------------------
FIXTURES = [
    dict(
        name="tiny_f32_hc4_ple1",
        notes="baseline fp32; hc_count 4; one PLE layer [2]; 2 sparse-attention layers; GQA 4/2, head_dim 16, "
        "partial_rotary 0.25; per-expert layout as save_pretrained writes it; EOS x2 in a row + 1 more",
        dtype="float32", layout="per_expert", vl=False, shard=None,
        prompt_len=48, eos_positions=[9, 10, 30],
        cfg=dict(vocab_size=320, hidden_size=32, layer_types=[L, L, L, S, L, S],
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.25,
                 indexer_n_heads=2, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                 hc_count=4, hc_lowrank=8, ple_layer_ids=[2], ple_embed_dim=32, ngram_vocab_size_base=1000,
                 split_ngram_parts=1, eos_token_id=1, output_gate_type="sigmoid"),
    ),
    dict(
        name="tiny_f32_hc3_ple2_fused_silu",
        notes="fp32; hc_count 3; two PLE layers [1, 3]; FUSED expert layout (mlp.experts.gate_up_proj / down_proj); "
        "output_gate_type silu; GQA 6/2, head_dim 8, partial_rotary 0.5; EOS = vocab-1 at 0, 17, 18; "
        "ple_embed_dim 32 != hidden 48; PLE tables split in 2 row shards",
        dtype="float32", layout="fused", vl=False, shard=None,
        prompt_len=56, eos_positions=[0, 17, 18],
        cfg=dict(vocab_size=320, hidden_size=48, layer_types=[L, L, L, S, L, S],
                 num_attention_heads=6, num_key_value_heads=2, head_dim=8, partial_rotary_factor=0.5,
                 indexer_n_heads=4, indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=4,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=12, linear_value_head_dim=12,
                 num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                 hc_count=3, hc_lowrank=12, ple_layer_ids=[1, 3], ple_embed_dim=32, ngram_vocab_size_base=700,
                 split_ngram_parts=2, eos_token_id=319, output_gate_type="silu"),
    ),
    dict(
        name="tiny_bf16_hc4",
        notes="BF16 weights; logits.f32 = fp32 forward of the bf16 weights upcast to fp32; logits_native.f32 = HF "
        "forward run natively in bfloat16 (looser bound); hc_count 4; PLE [2] split in 4 row shards; "
        "GQA 8/1, head_dim 16, partial_rotary 0.5; 16 experts top-4",
        dtype="bfloat16", layout="per_expert", vl=False, shard=None,
        prompt_len=44, eos_positions=[20, 21],
        cfg=dict(vocab_size=256, hidden_size=64, layer_types=[L, L, L, S],
                 num_attention_heads=8, num_key_value_heads=1, head_dim=16, partial_rotary_factor=0.5,
                 indexer_n_heads=3, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                 num_experts=16, num_experts_per_tok=4, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                 hc_count=4, hc_lowrank=16, ple_layer_ids=[2], ple_embed_dim=64, ngram_vocab_size_base=1500,
                 split_ngram_parts=4, eos_token_id=1, output_gate_type="sigmoid"),
    ),
    dict(
        name="tiny_vl_sharded",
        notes="full VL form: config.json model_type qwen4_exp with text_config nested, layer_types spelled "
        "'full_attention', tensor keys prefixed model.language_model. (lm_head.weight unprefixed); sharded "
        "safetensors + model.safetensors.index.json; hidden 40 with ple_embed_dim 32 (!= hidden); MHA 4/4, "
        "head_dim 12, partial_rotary 0.5 (6 rotary dims); PLE split in 2",
        dtype="float32", layout="per_expert", vl=True, shard="400KB",
        prompt_len=64, eos_positions=[5, 33, 34],
        cfg=dict(vocab_size=288, hidden_size=40, layer_types=[L, L, L, S, L, L, S],
                 num_attention_heads=4, num_key_value_heads=4, head_dim=12, partial_rotary_factor=0.5,
                 indexer_n_heads=4, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=10,
                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=20,
                 hc_count=4, hc_lowrank=10, ple_layer_ids=[2], ple_embed_dim=32, ngram_vocab_size_base=600,
                 split_ngram_parts=2, eos_token_id=287, output_gate_type="sigmoid"),
    ),
    dict(
        name="tiny_f32_short_prompt",
        notes="fp32; short 7-token prompt (below the indexer's dense limit) starting with EOS; the greedy "
        "continuation crosses the dense limit during decode; indexer budget 8 ratio 2 (dense limit 9); hc_count 3; "
        "PLE [3]; 2 sparse-attention layers; 16 experts top-4; partial_rotary 0.25 with head_dim 32",
        dtype="float32", layout="per_expert", vl=False, shard=None,
        prompt_len=7, eos_positions=[0],
        cfg=dict(vocab_size=300, hidden_size=32, layer_types=[L, S, L, S, L],
                 num_attention_heads=2, num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.25,
                 indexer_n_heads=4, indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=2,
                 linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                 num_experts=16, num_experts_per_tok=4, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                 hc_count=3, hc_lowrank=8, ple_layer_ids=[3], ple_embed_dim=32, ngram_vocab_size_base=800,
                 split_ngram_parts=1, eos_token_id=2, output_gate_type="sigmoid"),
    ),
]


# ----------------------------------------------------------------------------------------------------------------
def stable_seed(*parts) -> int:
    h = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 62) - 1)


def build_config(cfg: dict) -> Qwen4ExpTextConfig:
    cfg = dict(cfg)
    prf = cfg.pop("partial_rotary_factor", 0.25)
    head_dim = cfg["head_dim"]
    n_freq = int(head_dim * prf) // 2
    # mrope_section only matters for multimodal positions (all three rows are equal for text); keep it consistent
    # with the rotary size anyway, as a real config would be.
    sec = [n_freq - 2 * (n_freq // 3), n_freq // 3, n_freq // 3]
    rope = {"rope_type": "default", "rope_theta": float(cfg.pop("rope_theta", 10000.0)),
            "partial_rotary_factor": prf, "mrope_section": sec, "mrope_interleaved": True}
    cfg.setdefault("indexer_kv_heads", 1)
    cfg.setdefault("rms_norm_eps", 1e-6)
    cfg["num_hidden_layers"] = len(cfg["layer_types"])
    return Qwen4ExpTextConfig(rope_parameters=rope, **cfg)


def _normal(g, shape, std, mean=0.0):
    return torch.randn(shape, generator=g, dtype=torch.float32) * std + mean


@torch.no_grad()
def randomize(model: Qwen4ExpForCausalLM, g: torch.Generator):
    """Give every floating-point parameter a non-trivial random value (HF zero-inits RMSNorm weights, the PLE conv,
    ...).  Rules by parameter name; anything not covered raises so new parameters cannot slip through."""
    cfg = model.config
    Sc = cfg.hc_count
    for name, p in model.named_parameters():
        shp = tuple(p.shape)
        if name.endswith("embed_tokens.weight"):
            v = _normal(g, shp, 1.0)
        elif "ngram_embedding" in name:
            v = _normal(g, shp, 1.0)
        elif name.endswith("linear_attn.A_log"):
            v = torch.log(torch.rand(shp, generator=g) * 3.5 + 0.5)
        elif name.endswith("linear_attn.dt_bias"):
            v = _normal(g, shp, 0.5)
        elif name.endswith("linear_attn.norm.weight"):  # gated RMSNorm: plain w
            v = _normal(g, shp, 0.2, 1.0)
        elif name.endswith("conv1d.weight"):  # GDN conv and PLE dilated conv
            v = _normal(g, shp, 0.5)
        elif p.ndim == 1:  # every other 1-D float parameter is a zero-centred RMSNorm weight (used as 1 + w)
            v = _normal(g, shp, 0.2)
        elif name.endswith("mlp.gate.weight"):  # router: spread so expert choice varies by token
            v = _normal(g, shp, 2.5 / math.sqrt(shp[1]))
        elif name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]
            v = _normal(g, shp, 1.0 / math.sqrt(shp[2]))
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            v = _normal(g, shp, 1.0 / math.sqrt(shp[2]))
        elif name.endswith("input_mix_weight_down.weight") or name.endswith("block_inject_weight.weight"):
            # these are divided by hc_count before the activation
            v = _normal(g, shp, Sc / math.sqrt(shp[1]))
        elif p.ndim == 2:  # ordinary nn.Linear weight [out, in]
            v = _normal(g, shp, 1.0 / math.sqrt(shp[1]))
        else:
            raise RuntimeError(f"no randomisation rule for parameter {name} {shp}")
        p.copy_(v.to(p.dtype))


# ----------------------------------------------------------------------------------------------------------------
# Fragility probes: router top-k boundary and QSA indexer block-selection boundary.
# ----------------------------------------------------------------------------------------------------------------
class Probes:
    def __init__(self, model):
        self.router_gap = math.inf
        self.indexer_gap = math.inf
        self.pruned_queries = 0
        self.handles = []
        for mod in model.modules():
            if isinstance(mod, mq.Qwen4ExpTextTopKRouter):
                self.handles.append(mod.register_forward_hook(self._router_hook))
            elif isinstance(mod, mq.Qwen4ExpTextQSAIndexer):
                self.handles.append(mod.register_forward_pre_hook(self._indexer_hook))

    def close(self):
        for h in self.handles:
            h.remove()

    def _router_hook(self, mod, args, out):
        logits = out[0].float()
        k = mod.top_k
        if k < logits.shape[-1]:
            s = logits.sort(dim=-1, descending=True).values
            self.router_gap = min(self.router_gap, float((s[:, k - 1] - s[:, k]).min()))

    @torch.no_grad()
    def _indexer_hook(self, mod, args):
        hidden_states, position_embeddings, attention_mask, past_key_values = args
        if past_key_values is not None:  # only probed on cache-less one-shot forwards
            return
        assert hidden_states.shape[0] == 1
        T = hidden_states.shape[1]
        D, r, kb = mod.index_head_dim, mod.compress_ratio, mod.block_topk
        full_cos, full_sin = position_embeddings
        qk = mod.index_qk_proj(hidden_states)
        q, tk = torch.split(qk, [mod.index_n_heads * D, mod.index_kv_heads * D], dim=-1)
        q = mod.q_layernorm(q.reshape(1, T, -1, D))
        q = mq.apply_rotary_pos_emb(q, cos=full_cos[:, -T:], sin=full_sin[:, -T:], unsqueeze_dim=2)
        raw = tk.reshape(1, T, D)[0]
        for t in range(T):
            n = t + 1
            nb = n // r
            if nb <= kb:
                continue
            pooled = raw[: nb * r].view(nb, r, D).float().mean(dim=1).to(raw.dtype)
            pooled = mod.k_layernorm(pooled)
            starts = torch.arange(nb) * r
            kbk = mq.apply_rotary_pos_emb(pooled.unsqueeze(1), cos=full_cos[0].index_select(0, starts),
                                          sin=full_sin[0].index_select(0, starts)).squeeze(1)
            sc = torch.relu(q[0, t].float() @ kbk.float().T).sum(0) / math.sqrt(D)
            s = sc.sort(descending=True).values
            self.indexer_gap = min(self.indexer_gap, float(s[kb - 1] - s[kb]))
            self.pruned_queries += 1


# ----------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def logits_oneshot(model, ids: list[int]) -> torch.Tensor:
    out = model(input_ids=torch.tensor([ids]), use_cache=False)
    return out.logits[0].float()


@torch.no_grad()
def logits_chunked(model, ids: list[int], chunk: int) -> torch.Tensor:
    pkv, outs = None, []
    for s in range(0, len(ids), chunk):
        out = model(input_ids=torch.tensor([ids[s:s + chunk]]), past_key_values=pkv, use_cache=True)
        pkv = out.past_key_values
        outs.append(out.logits[0].float())
    return torch.cat(outs, 0)


@torch.no_grad()
def greedy(model, ids: list[int], n: int):
    """Manual greedy loop with the HF cache: prefill, then one token at a time; argmax of fp32 logits; no EOS stop."""
    out = model(input_ids=torch.tensor([ids]), use_cache=True)
    pkv = out.past_key_values
    last = out.logits[0, -1].float()
    gen, margins = [], []
    for i in range(n):
        top2 = torch.topk(last, 2)
        margins.append(float(top2.values[0] - top2.values[1]))
        tok = int(top2.indices[0])
        gen.append(tok)
        if i == n - 1:
            break
        out = model(input_ids=torch.tensor([[tok]]), past_key_values=pkv, use_cache=True)
        pkv = out.past_key_values
        last = out.logits[0, -1].float()
    return gen, margins


def make_prompt(rng: random.Random, vocab: int, eos: int, length: int, eos_positions) -> list[int]:
    ids = []
    for _ in range(length):
        t = rng.randrange(vocab - 1)
        ids.append(t if t < eos else t + 1)  # uniform over the vocab minus EOS
    for p in eos_positions:
        ids[p] = eos
    return ids


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# ----------------------------------------------------------------------------------------------------------------
# Saving
# ----------------------------------------------------------------------------------------------------------------
def _read_dir_tensors(d: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for fn in sorted(os.listdir(d)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(d, fn), "pt") as f:
                for k in f.keys():
                    tensors[k] = f.get_tensor(k)
    return tensors


def save_checkpoint(model, spec: dict, out_dir: str, save_dtype: torch.dtype):
    """Write the HF model directory in the layout spec asks for."""
    tmp = tempfile.mkdtemp(prefix="q4fx_")
    try:
        m = model if save_dtype == torch.float32 else copy.deepcopy(model).to(save_dtype)
        kw = {"max_shard_size": spec["shard"]} if spec.get("shard") else {}
        m.save_pretrained(tmp, **kw)
        files = sorted(os.listdir(tmp))
        os.makedirs(out_dir, exist_ok=True)

        if spec["layout"] == "fused":
            assert not spec.get("shard") and not spec.get("vl"), "fused layout is written unsharded, text-only"
            tensors = _read_dir_tensors(tmp)
            tensors = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
            sd = m.state_dict()
            for k, v in sd.items():
                if k.endswith(".mlp.experts.gate_up_proj") or k.endswith(".mlp.experts.down_proj"):
                    tensors[k] = v.detach().clone().contiguous()
            tensors = dict(sorted(tensors.items()))
            save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
            shutil.copy(os.path.join(tmp, "config.json"), os.path.join(out_dir, "config.json"))
        elif spec.get("vl"):
            index_path = os.path.join(tmp, "model.safetensors.index.json")
            rename = lambda k: ("model.language_model." + k[len("model."):]) if k.startswith("model.") else k  # noqa
            for fn in files:
                if fn.endswith(".safetensors"):
                    with safe_open(os.path.join(tmp, fn), "pt") as f:
                        meta = f.metadata() or {"format": "pt"}
                        t = {rename(k): f.get_tensor(k) for k in f.keys()}
                    save_file(t, os.path.join(out_dir, fn), metadata=meta)
            if os.path.exists(index_path):
                idx = json.load(open(index_path))
                idx["weight_map"] = {rename(k): v for k, v in sorted(idx["weight_map"].items())}
                with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
                    json.dump(idx, f, indent=2)
                    f.write("\n")
            text = json.load(open(os.path.join(tmp, "config.json")))
            text["layer_types"] = ["full_attention" if t == S else t for t in text["layer_types"]]
            text.pop("architectures", None)
            text.pop("transformers_version", None)
            vl = {
                "architectures": ["Qwen4ExpForConditionalGeneration"],
                "model_type": "qwen4_exp",
                "text_config": text,
                "tie_word_embeddings": False,
                "image_token_id": 248056, "video_token_id": 248057,
                "vision_start_token_id": 248053, "vision_end_token_id": 248054,
                "transformers_version": transformers.__version__,
            }
            with open(os.path.join(out_dir, "config.json"), "w") as f:
                json.dump(vl, f, indent=2)
                f.write("\n")
        else:
            for fn in files:
                if fn.endswith(".safetensors") or fn in ("config.json", "model.safetensors.index.json"):
                    shutil.copy(os.path.join(tmp, fn), os.path.join(out_dir, fn))
        if spec.get("shard"):
            n_shards = len([f for f in os.listdir(out_dir) if f.endswith(".safetensors")])
            assert n_shards >= 2 and os.path.exists(os.path.join(out_dir, "model.safetensors.index.json")), \
                f"expected >= 2 shards, got {n_shards}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@torch.no_grad()
def reload_model(out_dir: str, spec: dict, dtype: torch.dtype, text_cfg: Qwen4ExpTextConfig):
    """Load the saved directory back with HF's own from_pretrained (it reads the sharded, fused-expert and VL forms:
    for the VL config it picks the nested text_config, maps 'full_attention' to 'qwen_sparse_attention' and strips
    the model.language_model. prefix)."""
    model = Qwen4ExpForCausalLM.from_pretrained(out_dir, dtype=dtype).eval()
    assert model.config.layer_types == text_cfg.layer_types, (model.config.layer_types, text_cfg.layer_types)
    return model


def check_nonconstant(out_dir: str):
    bad = []
    for k, v in _read_dir_tensors(out_dir).items():
        if v.is_floating_point():
            f = v.float()
            if f.numel() > 1 and float(f.max() - f.min()) == 0.0:
                bad.append(k)
            elif f.numel() == 1 and float(f) == 0.0:
                bad.append(k)
    if bad:
        raise RuntimeError(f"constant floating-point tensors in {out_dir}: {bad}")
    # the int64 PLE buffers must be in the checkpoint, one set per PLE layer
    cfg = json.load(open(os.path.join(out_dir, "config.json")))
    n_ple = len(cfg.get("text_config", cfg).get("ple_layer_ids") or [])
    keys = list(_read_dir_tensors(out_dir).keys())
    for k in ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets"):
        n = sum(1 for key in keys if key.endswith("ple_embedding." + k))
        assert n == n_ple, f"{out_dir}: {n} tensors *.ple_embedding.{k}, expected {n_ple}"


def dump_json(obj: dict) -> str:
    """Pretty JSON with one key per line but integer lists kept on one line."""
    lines = ["{"]
    items = list(obj.items())
    for i, (k, v) in enumerate(items):
        sep = "," if i + 1 < len(items) else ""
        lines.append(f"  {json.dumps(k)}: {json.dumps(v)}{sep}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def dir_bytes(d: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


# ----------------------------------------------------------------------------------------------------------------
class FragileFixture(RuntimeError):
    pass


def make_fixture(spec: dict, out_root: str, seed: int, max_attempts: int = 25, size_limit: int | None = None):
    name = spec["name"]
    out_dir = os.path.join(out_root, name)
    cfg = build_config(spec["cfg"])
    eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, list) else cfg.eos_token_id
    is_bf16 = spec["dtype"] == "bfloat16"
    for attempt in range(max_attempts):
        aseed = stable_seed(seed, name, attempt)
        torch.manual_seed(aseed)  # HF's own init (overwritten anyway)
        g = torch.Generator().manual_seed(aseed)
        model = Qwen4ExpForCausalLM(copy.deepcopy(cfg)).eval()
        randomize(model, g)
        if is_bf16:  # the reference model is the bf16-rounded weights held in fp32
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(p.to(torch.bfloat16).float())
        rng = random.Random(aseed)
        prompt = make_prompt(rng, cfg.vocab_size, eos, spec["prompt_len"], spec["eos_positions"])

        # calibrate the lm_head scale so the logits spread several units
        lg = logits_oneshot(model, prompt)
        with torch.no_grad():
            model.lm_head.weight.mul_(LOGIT_STD_TARGET / float(lg.std()))
            if is_bf16:
                model.lm_head.weight.copy_(model.lm_head.weight.to(torch.bfloat16).float())

        probes = Probes(model)
        ref = logits_oneshot(model, prompt)
        gen, margins = greedy(model, prompt, N_GREEDY)
        full = prompt + gen
        lg_full = logits_oneshot(model, full[:-1])
        probes.close()
        why = []
        if min(margins) < GREEDY_MARGIN_MIN:
            why.append(f"greedy margin {min(margins):.2e}")
        if probes.router_gap < ROUTER_GAP_MIN:
            why.append(f"router gap {probes.router_gap:.2e}")
        if probes.indexer_gap < INDEXER_GAP_MIN:
            why.append(f"indexer gap {probes.indexer_gap:.2e}")
        if why:
            print(f"  [{name}] attempt {attempt} rejected: {', '.join(why)}", flush=True)
            continue
        break
    else:
        raise FragileFixture(f"{name}: no robust fixture after {max_attempts} attempts")

    # --- self checks on the in-memory model --------------------------------------------------------------------
    P = len(prompt)
    regen = lg_full[P - 1:].argmax(-1).tolist()
    assert regen == gen, f"{name}: one-shot argmax over prompt+continuation {regen} != cached greedy {gen}"
    chunk_errs = {}
    for c in (5, 1):
        chunk_errs[c] = rel_err(logits_chunked(model, prompt, c), ref)
        assert chunk_errs[c] < CHUNK_REL_TOL, f"{name}: chunk {c} vs one-shot rel err {chunk_errs[c]:.2e}"
    assert rel_err(lg_full[:P], ref) < CHUNK_REL_TOL
    if P > cfg.indexer_budget + cfg.indexer_compress_ratio - 1:
        assert probes.pruned_queries > 0, f"{name}: the indexer never pruned"

    # --- write --------------------------------------------------------------------------------------------------
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    save_checkpoint(model, spec, out_dir, torch.bfloat16 if is_bf16 else torch.float32)
    check_nonconstant(out_dir)

    reloaded = reload_model(out_dir, spec, torch.float32, cfg)
    re32 = rel_err(logits_oneshot(reloaded, prompt), ref)
    assert re32 < RELOAD_REL_TOL, f"{name}: reloaded checkpoint differs from the in-memory model: {re32:.2e}"
    del reloaded

    ref_np = ref.numpy().astype("<f4")
    ref_np.tofile(os.path.join(out_dir, "logits.f32"))
    reference = {
        "prompt_ids": prompt,
        "greedy_ids": gen,
        "vocab_size": cfg.vocab_size,
        "logits_file": "logits.f32",
        "weights_dtype": spec["dtype"],
        "notes": spec["notes"],
    }
    native_err = None
    if is_bf16:
        native = reload_model(out_dir, spec, torch.bfloat16, cfg)
        nat = logits_oneshot(native, prompt)
        native_err = rel_err(nat, ref)
        nat.numpy().astype("<f4").tofile(os.path.join(out_dir, "logits_native.f32"))
        reference["logits_native_file"] = "logits_native.f32"
        reference["native_vs_fp32_rel_err"] = native_err
        del native
    reference["min_greedy_margin"] = min(margins)
    reference["min_router_gap"] = probes.router_gap
    reference["min_indexer_gap"] = probes.indexer_gap if probes.pruned_queries else None
    reference["indexer_pruned_queries"] = probes.pruned_queries
    reference["chunked_cache_rel_err"] = {str(k): v for k, v in chunk_errs.items()}
    reference["logits_std"] = float(ref.std())
    reference["generator"] = {"tool": "tools/make_fixtures.py", "seed": seed, "attempt": attempt,
                              "transformers": transformers.__version__, "torch": torch.__version__.split("+")[0]}
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        f.write(dump_json(reference))

    size = dir_bytes(out_dir)
    if size_limit is not None:
        assert size <= size_limit, f"{name}: {size} bytes > {size_limit}"
    print(f"[{name}] {size / 1e6:.2f} MB, prompt {P} tokens, greedy margin min {min(margins):.3e}, router gap "
          f"{probes.router_gap:.3e}, indexer gap {probes.indexer_gap:.3e} ({probes.pruned_queries} pruned queries), "
          f"chunk rel err {chunk_errs[5]:.1e}/{chunk_errs[1]:.1e}, logits std {float(ref.std()):.2f}"
          + (f", native bf16 rel err {native_err:.2e}" if native_err is not None else "")
          + f", attempt {attempt}", flush=True)
    return reference


# ----------------------------------------------------------------------------------------------------------------
# Random mode
# ----------------------------------------------------------------------------------------------------------------
def random_spec(rng: random.Random, idx: int, wild: bool) -> dict:
    H = rng.choice([16, 24, 32, 40, 48, 64])
    V = rng.randrange(256, 513)
    n_layers = rng.randint(3, 8)
    types = [rng.choice([L, L, S]) for _ in range(n_layers)]
    if S not in types:  # HF's cache needs an attention layer to count the sequence length
        types[rng.randrange(n_layers)] = S
    if L not in types:
        types[0] = L
    lin_ids = [i + 1 for i, t in enumerate(types) if t == L]
    n_ple = rng.choice([0, 1, 1, 2])
    ple_ids = sorted(rng.sample(lin_ids, min(n_ple, len(lin_ids))))
    kv = rng.choice([1, 2, 4])
    heads = kv * rng.choice([1, 2, 3])
    head_dim = rng.choice([8, 12, 16, 32])
    prf = rng.choice([0.25, 0.5, 1.0])
    rot = int(head_dim * prf)
    if rot % 2:
        prf, rot = 0.5, head_dim // 2
    idx_hd = rng.choice([d for d in (8, 16, 32) if d >= rot] or [rot])
    ratio = rng.choice([2, 4])
    budget = ratio * rng.choice([1, 2, 3])
    E = rng.choice([4, 8, 12, 16])
    ngram_size, hpn = 3, 8
    if wild:
        ngram_size, hpn = rng.choice([2, 3, 4]), rng.choice([4, 8])
    n_heads_ng = (ngram_size - 1) * hpn
    ple_dim = H if H % n_heads_ng == 0 and rng.random() < 0.5 else n_heads_ng * rng.choice([1, 2, 3])
    eos = rng.choice([0, 1, 2, V - 1])
    dtype = rng.choice(["float32", "float32", "bfloat16"])
    layout = rng.choice(["per_expert", "per_expert", "fused"])
    vl = layout == "per_expert" and rng.random() < 0.4
    shard = "200KB" if vl or (layout == "per_expert" and rng.random() < 0.3) else None
    lkh = rng.choice([1, 2])
    cfg = dict(vocab_size=V, hidden_size=H, layer_types=types,
               num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, partial_rotary_factor=prf,
               rope_theta=rng.choice([10000.0, 1e6, 1e7]),
               # 1-2 indexer heads give many exact zero-score ties (relu) that HF breaks arbitrarily
               indexer_n_heads=rng.choice([1, 2, 3, 4, 4, 4]), indexer_head_dim=idx_hd, indexer_budget=budget,
               indexer_compress_ratio=ratio,
               linear_num_key_heads=lkh, linear_num_value_heads=lkh * rng.choice([1, 2, 3]),
               linear_key_head_dim=rng.choice([4, 8, 12, 16]), linear_value_head_dim=rng.choice([4, 8, 12, 16]),
               num_experts=E, num_experts_per_tok=rng.randint(1, min(4, E)),
               moe_intermediate_size=rng.choice([8, 16, 24, 32]),
               shared_expert_intermediate_size=rng.choice([8, 16, 24, 32, 48]),
               hc_count=rng.choice([2, 3, 4]), hc_lowrank=rng.choice([4, 8, 12, 16]),
               ple_layer_ids=ple_ids, ple_embed_dim=ple_dim, ngram_vocab_size_base=rng.randrange(300, 2001),
               ngram_size=ngram_size, heads_per_ngram=hpn,
               split_ngram_parts=rng.choice([1, 2, 4]), eos_token_id=eos,
               output_gate_type=rng.choice(["sigmoid", "sigmoid", "silu"]),
               make_ngram_vocab_size_divisible_by=128, seed=rng.randrange(1 << 16))
    if wild:
        cfg["linear_conv_kernel_dim"] = rng.choice([2, 3, 4])
        cfg["ple_conv_kernel_size"] = rng.choice([2, 3, 4])
    plen = rng.choice([rng.randint(1, budget + ratio - 1), rng.randint(16, 64), rng.randint(16, 64)])
    n_eos = min(plen, rng.choice([0, 1, 2, 3]))
    eos_pos = sorted(rng.sample(range(plen), n_eos))
    if n_eos >= 2 and rng.random() < 0.5 and eos_pos[0] + 1 < plen:
        eos_pos[1] = eos_pos[0] + 1
        eos_pos = sorted(set(eos_pos))
    return dict(name=f"rand_{idx:03d}", dtype=dtype, layout=layout, vl=vl, shard=shard, prompt_len=plen,
                eos_positions=eos_pos,
                notes=f"random fixture {idx}: layout {layout}, vl {vl}, shard {shard}, dtype {dtype}",
                cfg=cfg)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output root (one sub-directory per fixture)")
    ap.add_argument("--seed", type=int, default=20260101)
    ap.add_argument("--random", type=int, default=0, metavar="K",
                    help="instead of the fixed set, make K checkpoints with randomly varied shapes/options")
    ap.add_argument("--wild", action="store_true",
                    help="random mode: also vary ngram_size, heads_per_ngram and the conv kernel sizes")
    ap.add_argument("--only", nargs="*", help="fixed set: only these fixture names")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    summary = {}
    if args.random:
        rng = random.Random(args.seed)
        made, draws = 0, 0
        while made < args.random:
            draws += 1
            if draws > 4 * args.random + 10:
                raise RuntimeError("too many random specs were fragile")
            spec = random_spec(rng, made, args.wild)
            print(f"[{spec['name']}] {json.dumps(spec['cfg'])}", flush=True)
            try:
                make_fixture(spec, args.out, args.seed, max_attempts=12)
            except FragileFixture as e:
                # typically exact zero-score ties in the QSA indexer (every head's relu is 0), which HF's
                # torch.topk breaks in an implementation-defined order: draw another spec
                print(f"  {e}; drawing another spec", flush=True)
                continue
            made += 1
            summary[spec["name"]] = spec
            with open(os.path.join(args.out, spec["name"], "fixture_spec.json"), "w") as f:
                json.dump(spec, f, indent=1)
                f.write("\n")
    else:
        for spec in FIXTURES:
            if args.only and spec["name"] not in args.only:
                continue
            make_fixture(spec, args.out, args.seed, size_limit=MAX_FIXTURE_BYTES)
    total = sum(dir_bytes(os.path.join(args.out, d)) for d in os.listdir(args.out)
                if os.path.isdir(os.path.join(args.out, d)))
    print(f"done: {args.out} ({total / 1e6:.2f} MB in fixture directories)")


if __name__ == "__main__":
    main()
