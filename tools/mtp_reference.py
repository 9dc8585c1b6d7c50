#!/usr/bin/env python3
"""PyTorch reference of the qwen4_exp (Qwen3.8-Flash-Next) MTP head, built from transformers' own qwen4_exp classes.

transformers has no MTP head; the definition followed here is SGLang's `Qwen4ExpForCausalLMMTP`
(python/sglang/srt/models/qwen4_exp_mtp.py) and vLLM's `Qwen4ExpMultiTokenPredictor`
(vllm/models/qwen4_exp/nvidia/mtp.py); see docs/MTP.md for what was checked in those sources.

For a row pairing the trunk's residual stack R (S streams of H, taken BEFORE the trunk's final mixer) at position p
with the token x that follows it (the token at p+1):

    e        = fc_embedding( RMS0(embed[x]; pre_fc_norm_embedding) )                          [H]
    h_hat    = RMS0(R; pre_fc_norm_hidden)        ONE norm over all S*H values, weight (1 + w) [S*H]
    R'[c,:]  = fc_hidden( h_hat[c,:] ) + e        for every stream c (fc_hidden shared by the streams)
    R''      = mtp.layers.0(R')                   one sparse-attention (QSA indexer) + MoE decoder layer with both
                                                  hyper-connection modules, no PLE, RoPE at position p; the rows of
                                                  one call form ONE causal sequence with the head's own K/V/indexer
    logits   = lm_head( mtp.hyper_connection_mixer.read(R'') )   (trunk's lm_head; mixer has no inject weight)

R'' (the head's pre-mixer stack) is what a chained draft feeds back in place of R.

API (imported by other tools; keep it stable):
    MtpHead(config)                                   parameters named like the checkpoint minus the "mtp." prefix
    MtpHead.forward(stacks, next_ids, embed_tokens, position_ids) -> R''   [B, T, S*H]
    MtpHead.logits(head_stacks, lm_head) -> logits    [B, T, V]
    trunk_stacks(model, input_ids) -> [B, T, S*H]     (forward hook on the trunk's final mixer input)
    save_with_mtp(model, head, directory, **save_kwargs)
Extras: mtp_checkpoint_tensors(head, layout, dtype), append_mtp_tensors(directory, tensors),
        read_mtp_tensors(directory), MtpHead.load_checkpoint_tensors(tensors).
"""
from __future__ import annotations

import copy
import json
import os
import re

import torch
from torch import nn

from transformers import Qwen4ExpTextConfig
from transformers.models.qwen4_exp import modeling_qwen4_exp as mq

MTP_PREFIX = "mtp."


def _text_config(config):
    return getattr(config, "text_config", None) or config


class MtpHead(nn.Module):
    """The MTP head. state_dict() keys prefixed with "mtp." are the checkpoint names, except that the routed experts
    of layers.0 are held fused (`layers.0.mlp.experts.gate_up_proj` [E, 2I, H] gate rows first,
    `layers.0.mlp.experts.down_proj` [E, H, I]) as transformers holds them; `mtp_checkpoint_tensors` writes them
    per expert (`mtp.layers.0.mlp.experts.{e}.{gate,up,down}_proj.weight`, the default) or fused."""

    def __init__(self, config: Qwen4ExpTextConfig):
        super().__init__()
        config = _text_config(config)
        self.config = config
        S, H = config.hc_count, config.hidden_size
        self.hc_count, self.hidden_size = S, H
        # config of the one decoder layer: layer 0 is a sparse-attention (QSA) layer, no PLE
        lc = copy.deepcopy(config)
        lc.layer_types = ["qwen_sparse_attention"]
        lc.num_hidden_layers = 1
        lc.ple_layer_ids = []
        impl = getattr(config, "_attn_implementation", None) or "sdpa"
        if impl not in ("sdpa", "eager"):
            impl = "sdpa"
        lc._attn_implementation = impl
        self.layer_config = lc
        eps = config.rms_norm_eps
        self.pre_fc_norm_embedding = mq.Qwen4ExpTextRMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = mq.Qwen4ExpTextRMSNorm(S * H, group_size=None, eps=eps)  # ONE group of S*H
        self.fc_embedding = nn.Linear(H, H, bias=False)
        self.fc_hidden = nn.Linear(H, H, bias=False)
        self.layers = nn.ModuleList([mq.Qwen4ExpTextDecoderLayer(lc, 0)])
        self.hyper_connection_mixer = mq.Qwen4ExpTextGatedResidual(config, use_combine=False)
        self.rotary_emb = mq.Qwen4ExpTextRotaryEmbedding(config=lc)  # buffers only, not persistent
        assert self.layers[0].ple is None and self.layers[0].layer_type != "linear_attention"

    # -- the fold ----------------------------------------------------------------------------------------------
    def fold(self, stacks: torch.Tensor, next_ids: torch.Tensor, embed_tokens: nn.Embedding) -> torch.Tensor:
        """R' = fc_hidden(RMS0(R; pre_fc_norm_hidden) per stream) + fc_embedding(RMS0(embed[x]))  -> [B, T, S*H]"""
        S, H = self.hc_count, self.hidden_size
        if stacks.shape[-1] != S * H:
            raise ValueError(f"stacks have {stacks.shape[-1]} features, expected hc_count*hidden = {S * H}")
        e = self.fc_embedding(self.pre_fc_norm_embedding(embed_tokens(next_ids)))  # [B, T, H]
        h = self.pre_fc_norm_hidden(stacks)  # [B, T, S*H], one RMS over all S*H values
        h = self.fc_hidden(h.unflatten(-1, (S, H)))  # [B, T, S, H]
        return (h + e.unsqueeze(-2)).flatten(-2)

    def _positions(self, position_ids, B, T, device):
        if position_ids is None:
            position_ids = torch.arange(T, device=device)
        position_ids = torch.as_tensor(position_ids, device=device).long()
        if position_ids.ndim == 1:
            position_ids = position_ids.unsqueeze(0).expand(B, T)
        if position_ids.shape != (B, T):
            raise ValueError(f"position_ids {tuple(position_ids.shape)} do not match rows {(B, T)}")
        return position_ids

    def _causal_mask(self, B, T, dtype, device):
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        causal = causal.view(1, 1, T, T).expand(B, 1, T, T)
        if self.layer_config._attn_implementation == "sdpa":
            return causal
        return torch.where(causal, torch.zeros((), dtype=dtype, device=device),
                           torch.full((), torch.finfo(dtype).min, dtype=dtype, device=device))

    def forward(self, stacks: torch.Tensor, next_ids: torch.Tensor, embed_tokens: nn.Embedding,
                position_ids=None) -> torch.Tensor:
        """stacks [B, T, S*H]: trunk stacks before the final mixer (row t at position position_ids[t]);
        next_ids [B, T]: the token following each row. The T rows run as ONE causal sequence (one-shot, no cache;
        the QSA indexer prunes once a row sees more than budget + ratio - 1 rows). Returns R'' [B, T, S*H]."""
        B, T = next_ids.shape
        x = self.fold(stacks, next_ids, embed_tokens)
        pos = self._positions(position_ids, B, T, x.device)
        position_embeddings = self.rotary_emb(x, pos.unsqueeze(0).expand(3, B, T))
        mask = self._causal_mask(B, T, x.dtype, x.device)
        return self.layers[0](x, position_embeddings=position_embeddings, attention_mask=mask, conv_mask=None,
                              past_key_values=None, ple_input_ids=None)

    def read(self, head_stacks: torch.Tensor) -> torch.Tensor:
        return self.hyper_connection_mixer(head_stacks)

    def logits(self, head_stacks: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        return lm_head(self.read(head_stacks))

    # -- checkpoint names ----------------------------------------------------------------------------------------
    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor], strict: bool = True):
        """Load `mtp.*` tensors (names as in the checkpoint, per-expert or fused experts)."""
        sd = {}
        per_expert: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        pat = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
        for k, v in tensors.items():
            if not k.startswith(MTP_PREFIX):
                continue
            name = k[len(MTP_PREFIX):]
            if name == "hyper_connection_mixer.block_inject_weight.weight":
                continue  # vLLM drops it too: the MTP final mixer has no injection
            m = pat.match(name)
            if m:
                per_expert.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = v
            else:
                sd[name] = v
        for base, experts in per_expert.items():
            E = len(experts)
            assert sorted(experts) == list(range(E)), f"{base}: experts {sorted(experts)}"
            sd[base + ".gate_up_proj"] = torch.stack([torch.cat([experts[e]["gate"], experts[e]["up"]], 0)
                                                      for e in range(E)])
            sd[base + ".down_proj"] = torch.stack([experts[e]["down"] for e in range(E)])
        own = self.state_dict()
        sd = {k: v.to(own[k].dtype) if k in own else v for k, v in sd.items()}
        return self.load_state_dict(sd, strict=strict)


def mtp_checkpoint_tensors(head: MtpHead, layout: str = "per_expert", dtype: torch.dtype | None = None):
    """The head's tensors under their checkpoint names ("mtp." + state_dict key), routed experts per expert
    (`layout="per_expert"`, as save_pretrained writes the trunk's) or fused (`layout="fused"`)."""
    if layout not in ("per_expert", "fused"):
        raise ValueError(f"layout must be per_expert or fused, not {layout!r}")
    out = {}
    for k, v in head.state_dict().items():
        v = v.detach()
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        if layout == "per_expert" and k.endswith(".mlp.experts.gate_up_proj"):
            base = k[: -len(".gate_up_proj")]
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{MTP_PREFIX}{base}.{e}.gate_proj.weight"] = v[e, :inter].clone().contiguous()
                out[f"{MTP_PREFIX}{base}.{e}.up_proj.weight"] = v[e, inter:].clone().contiguous()
        elif layout == "per_expert" and k.endswith(".mlp.experts.down_proj"):
            base = k[: -len(".down_proj")]
            for e in range(v.shape[0]):
                out[f"{MTP_PREFIX}{base}.{e}.down_proj.weight"] = v[e].clone().contiguous()
        else:
            out[MTP_PREFIX + k] = v.clone().contiguous()
    return dict(sorted(out.items()))


# ---------------------------------------------------------------------------------------------------------------------
def trunk_stacks(model, input_ids) -> torch.Tensor:
    """[B, T, S*H]: the trunk's residual stacks entering its final mixer (one-shot forward, no cache)."""
    if not torch.is_tensor(input_ids):
        input_ids = torch.tensor(input_ids)
    if input_ids.ndim == 1:
        input_ids = input_ids.unsqueeze(0)
    inner = model.model
    mixer = getattr(inner, "hyper_connection_mixer", None)
    if mixer is None:  # VL wrapper
        mixer = inner.language_model.hyper_connection_mixer
    captured = []
    handle = mixer.register_forward_pre_hook(lambda mod, args: captured.append(args[0].detach().clone()))
    try:
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=False)
    finally:
        handle.remove()
    assert len(captured) == 1
    return captured[0]


# ---------------------------------------------------------------------------------------------------------------------
def _safetensors_files(directory):
    return sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))


def read_mtp_tensors(directory: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open
    out = {}
    for fn in _safetensors_files(directory):
        with safe_open(os.path.join(directory, fn), "pt") as f:
            for k in f.keys():
                if k.startswith(MTP_PREFIX):
                    out[k] = f.get_tensor(k)
    return out


def append_mtp_tensors(directory: str, tensors: dict[str, torch.Tensor]):
    """Write `tensors` into an existing HF checkpoint directory. Single file: rewritten with the tensors added.
    Sharded: one more shard holding the tensors; every shard is renamed model-0000i-of-0000(N+1).safetensors and
    model.safetensors.index.json (weight_map, metadata.total_size) is rewritten to match."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if not os.path.exists(index_path):
        path = os.path.join(directory, "model.safetensors")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{directory}: neither model.safetensors nor an index")
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {"format": "pt"}
            all_t = {k: f.get_tensor(k) for k in f.keys()}
        clash = set(all_t) & set(tensors)
        if clash:
            raise ValueError(f"already in the checkpoint: {sorted(clash)[:5]}")
        all_t.update(tensors)
        save_file(dict(sorted(all_t.items())), path + ".tmp", metadata=meta)
        os.replace(path + ".tmp", path)
        return
    idx = json.load(open(index_path))
    wm = idx["weight_map"]
    clash = set(wm) & set(tensors)
    if clash:
        raise ValueError(f"already in the checkpoint: {sorted(clash)[:5]}")
    shards = sorted(set(wm.values()))
    n = len(shards) + 1
    rename = {}
    for i, old in enumerate(shards):
        new = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        rename[old] = new
    tmp_names = {}
    for old, new in rename.items():  # two-step rename so no file is overwritten
        tmp = old + ".renaming"
        os.replace(os.path.join(directory, old), os.path.join(directory, tmp))
        tmp_names[new] = tmp
    for new, tmp in tmp_names.items():
        os.replace(os.path.join(directory, tmp), os.path.join(directory, new))
    last = f"model-{n:05d}-of-{n:05d}.safetensors"
    save_file(dict(sorted(tensors.items())), os.path.join(directory, last), metadata={"format": "pt"})
    new_map = {k: rename[v] for k, v in wm.items()}
    new_map.update({k: last for k in tensors})
    idx["weight_map"] = dict(sorted(new_map.items()))
    total = 0
    for fn in set(new_map.values()):
        with safe_open(os.path.join(directory, fn), "pt") as f:
            for k in f.keys():
                t = f.get_slice(k)
                numel = 1
                for s in t.get_shape():
                    numel *= s
                total += numel * {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "F64": 8,
                                  "U8": 1, "I8": 1, "BOOL": 1}[t.get_dtype()]
    meta = idx.setdefault("metadata", {})
    meta["total_size"] = total
    if "total_parameters" in meta:
        meta["total_parameters"] = int(meta["total_parameters"]) + sum(t.numel() for t in tensors.values())
    with open(index_path, "w") as f:
        json.dump(idx, f, indent=2)
        f.write("\n")


def save_with_mtp(model, head: MtpHead, directory: str, **save_kwargs):
    """model.save_pretrained(directory, **save_kwargs), then the head's `mtp.*` tensors written into the checkpoint
    (single file or sharded, index kept consistent). Extra keywords (not passed to save_pretrained):
    mtp_layout="per_expert"|"fused" (default per_expert), mtp_dtype (default: the trunk's parameter dtype)."""
    layout = save_kwargs.pop("mtp_layout", "per_expert")
    dtype = save_kwargs.pop("mtp_dtype", None) or next(model.parameters()).dtype
    model.save_pretrained(directory, **save_kwargs)
    append_mtp_tensors(directory, mtp_checkpoint_tensors(head, layout, dtype))


def load_head(directory: str, config=None, dtype: torch.dtype = torch.float32) -> MtpHead:
    """An MtpHead with the `mtp.*` tensors of a checkpoint directory (config read from config.json if not given)."""
    if config is None:
        cfg = json.load(open(os.path.join(directory, "config.json")))
        cfg = cfg.get("text_config", cfg)
        cfg.pop("model_type", None)
        cfg["layer_types"] = ["qwen_sparse_attention" if t == "full_attention" else t for t in cfg["layer_types"]]
        config = Qwen4ExpTextConfig(**cfg)
    head = MtpHead(config).to(dtype)
    head.load_checkpoint_tensors(read_mtp_tensors(directory))
    return head.eval()
