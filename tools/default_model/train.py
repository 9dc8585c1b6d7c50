#!/usr/bin/env python3
"""Trains Vavilov's bundled default model: a small qwen4_exp (transformers' Qwen4ExpForCausalLM) with its MTP head.

Every part of the architecture is present and trained: hyper-connections (hc_count 4), Gated DeltaNet and QSA sparse
attention layers (3:1), an indexer budget that prunes beyond 67 tokens, one PLE layer with a small n-gram table,
a routed MoE with a shared expert in every layer, and one MTP layer (tools/mtp_reference.py) trained jointly:

    loss = CE(trunk logits at t, x_{t+1}) + lambda * CE(MTP logits at t, x_{t+2}) + router aux loss,

where the MTP head at row t reads the trunk's pre-final-mixer stack at t and the TRUE token x_{t+1}.

Data: build/default_model/corpus.jsonl.gz (make_corpus.py) and build/default_model/tokenizer (train_tokenizer.py);
documents are tokenised, each followed by <|endoftext|>, concatenated, and cut into random windows (train split);
the test split is evaluated at the end (held-out next-token loss, MTP draft-1 accuracy with the true x_{t+1}).

transformers' QSA indexer loops over every query in Python; this script replaces Qwen4ExpTextQSAIndexer.forward by
a vectorised version with the same selection (used only when every query sees a prefix of the keys, as in training
and cached decoding; anything else falls back to the original). `--check-patch` verifies it against the original.

Output (--out): a standard HF model directory (config.json with mtp_num_hidden_layers 1, model.safetensors in bf16
with the mtp.* tensors, tokenizer files, generation_config.json) and train_report.json.

Examples:
  python3 tools/default_model/train.py --check-patch
  python3 tools/default_model/train.py --device cuda --minutes 7 --out $OUT/default_model
  python3 tools/default_model/train.py --device cpu --minutes 1 --tiny --out build/default_model/tiny_run
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import os
import pathlib
import random
import shutil
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import transformers  # noqa: E402
from transformers import GenerationConfig, Qwen4ExpForCausalLM, Qwen4ExpTextConfig  # noqa: E402
from transformers.models.qwen4_exp import modeling_qwen4_exp as mq  # noqa: E402

from mtp_reference import MtpHead, save_with_mtp  # noqa: E402

# ---------------------------------------------------------------------------------------------------------------------
# Vectorised QSA indexer (same selection as Qwen4ExpTextQSAIndexer.forward)
# ---------------------------------------------------------------------------------------------------------------------
_ORIGINAL_INDEXER_FORWARD = mq.Qwen4ExpTextQSAIndexer.forward
PATCH_STATS = {"fast": 0, "fallback": 0}
_KEEP_SCORES = []  # --check-patch: non-empty -> the last block scores are kept here


def _fast_indexer_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values):
    """Per query i (visible keys 0..n_i-1, n_i = past + i + 1): blocks of `ratio` consecutive keys from position 0,
    nb_i = n_i // ratio complete ones; pooled key = RoPE_{block start}(k_layernorm(mean of the raw keys));
    score = sum_heads relu(q_h . K_b) / sqrt(d); keep the top min(budget/ratio, nb_i) blocks and the tail."""
    visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    B, T, _ = hidden_states.shape
    Tk = attention_mask.shape[-1]
    past = Tk - T
    dev = hidden_states.device
    kpos = torch.arange(Tk, device=dev)
    qcount = past + torch.arange(T, device=dev) + 1  # n_i
    prefix = kpos.view(1, Tk) < qcount.view(T, 1)  # [T, Tk]
    if past < 0 or visible.shape[1] != 1 or not torch.equal(visible[:, 0], prefix.expand(B, T, Tk)):
        PATCH_STATS["fallback"] += 1
        return _ORIGINAL_INDEXER_FORWARD(self, hidden_states, position_embeddings, attention_mask, past_key_values)
    PATCH_STATS["fast"] += 1

    D, r = self.index_head_dim, self.compress_ratio
    full_cos, full_sin = position_embeddings
    current_cos, current_sin = full_cos[:, -T:, :], full_sin[:, -T:, :]
    qk = self.index_qk_proj(hidden_states)
    q, token_k = torch.split(qk, [self.index_n_heads * D, self.index_kv_heads * D], dim=-1)
    q = q.reshape(B, T, -1, D)
    raw_keys = token_k.reshape(B, T, -1, D).squeeze(2)
    q = self.q_layernorm(q)
    q = mq.apply_rotary_pos_emb(q, cos=current_cos, sin=current_sin, unsqueeze_dim=2)
    if past_key_values is not None:
        raw_keys = past_key_values.update_indexer(raw_keys, self.layer_idx)

    NB = Tk // r
    sel = torch.zeros(B, T, Tk, dtype=torch.bool, device=dev)
    nb = qcount // r  # complete blocks per query [T]
    if NB > 0:
        blocks = raw_keys[:, : NB * r].reshape(B, NB, r, D)
        pooled = blocks.float().mean(dim=2).to(raw_keys.dtype)
        pooled = self.k_layernorm(pooled)
        starts = torch.arange(NB, device=dev) * r
        K = mq.apply_rotary_pos_emb(pooled.unsqueeze(2), cos=full_cos[:, starts], sin=full_sin[:, starts],
                                    unsqueeze_dim=2).squeeze(2)  # [B, NB, D]
        scores = torch.einsum("bthd,bnd->btnh", q.float(), K.float())
        scores = torch.relu(scores).sum(dim=-1) / math.sqrt(D)  # [B, T, NB]
        valid = torch.arange(NB, device=dev).view(1, NB) < nb.view(T, 1)  # [T, NB]
        scores = scores.masked_fill(~valid, float("-inf"))
        if _KEEP_SCORES:
            _KEEP_SCORES[:] = [scores]
        k = min(self.block_topk, NB)
        top = scores.topk(k, dim=-1).indices  # [B, T, k]
        top_ok = torch.gather(valid.expand(B, T, NB), -1, top)
        blk = torch.zeros(B, T, NB + 1, dtype=torch.bool, device=dev)
        blk.scatter_(-1, torch.where(top_ok, top, NB), True)
        blk = blk[..., :NB]
        sel[..., : NB * r] = blk.repeat_interleave(r, dim=-1)
    tail = (kpos.view(1, Tk) >= (nb * r).view(T, 1)) & prefix  # [T, Tk]
    sel |= tail.unsqueeze(0)
    sel = sel.unsqueeze(1)
    if attention_mask.is_floating_point():
        min_dtype = torch.finfo(attention_mask.dtype).min
        sel = torch.where(sel, attention_mask.new_zeros(()), min_dtype)
    return sel


def patch_indexer(enable: bool = True):
    mq.Qwen4ExpTextQSAIndexer.forward = _fast_indexer_forward if enable else _ORIGINAL_INDEXER_FORWARD


# ---------------------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------------------
def build_config(a, vocab_size: int, eos_id: int) -> Qwen4ExpTextConfig:
    L, S = "linear_attention", "qwen_sparse_attention"
    layer_types = [S if (i + 1) % a.attn_every == 0 else L for i in range(a.layers)]
    prf = a.partial_rotary
    n_freq = int(a.head_dim * prf) // 2
    sec = [n_freq - 2 * (n_freq // 3), n_freq // 3, n_freq // 3]
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": prf, "mrope_section": sec,
            "mrope_interleaved": True}
    return Qwen4ExpTextConfig(
        vocab_size=vocab_size, hidden_size=a.hidden, num_hidden_layers=a.layers, layer_types=layer_types,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.head_dim, rope_parameters=rope,
        linear_num_key_heads=a.gdn_k_heads, linear_num_value_heads=a.gdn_v_heads, linear_key_head_dim=a.gdn_dim,
        linear_value_head_dim=a.gdn_dim, linear_conv_kernel_dim=4,
        num_experts=a.experts, num_experts_per_tok=a.top_k, moe_intermediate_size=a.expert_dim,
        shared_expert_intermediate_size=a.shared_dim, norm_topk_prob=True, router_aux_loss_coef=a.aux_coef,
        hc_count=a.hc_count, hc_lowrank=a.hc_rank,
        ple_layer_ids=[a.ple_layer], ple_embed_dim=a.hidden, ngram_size=3, heads_per_ngram=8,
        ngram_vocab_size_base=a.ngram_base, split_ngram_parts=a.ngram_parts, ple_conv_kernel_size=4,
        indexer_n_heads=a.idx_heads, indexer_kv_heads=1, indexer_head_dim=a.idx_dim, indexer_budget=a.idx_budget,
        indexer_compress_ratio=a.idx_ratio, output_gate_type="sigmoid", rms_norm_eps=1e-6,
        max_position_embeddings=32768, tie_word_embeddings=False, eos_token_id=eos_id, pad_token_id=eos_id,
        bos_token_id=None, initializer_range=0.02, use_cache=True,
    )


def build_model(cfg, seed: int, attn_impl: str = "sdpa"):
    torch.manual_seed(seed)
    cfg._attn_implementation = attn_impl
    model = Qwen4ExpForCausalLM(cfg)
    head = MtpHead(cfg)
    # MtpHead is a plain nn.Module: give it the trunk's initialisation (experts are torch.empty otherwise).
    for m in head.modules():
        model._init_weights(m)
    with torch.no_grad():
        for n, p in list(model.named_parameters()) + list(head.named_parameters()):
            if not torch.isfinite(p).all():
                raise RuntimeError(f"non-finite initial parameter {n}")
    return model, head


def count_params(model, head):
    n_trunk = sum(p.numel() for p in model.parameters())
    n_head = sum(p.numel() for p in head.parameters())
    bufs = sum(b.numel() * b.element_size() for b in model.buffers() if b.dtype == torch.long)
    experts = sum(p.numel() for n, p in list(model.named_parameters()) + list(head.named_parameters())
                  if ".experts." in n)
    ple = sum(p.numel() for n, p in model.named_parameters() if "ngram_embedding" in n)
    cfg = model.config
    active = n_trunk + n_head - experts + experts * cfg.num_experts_per_tok // cfg.num_experts
    return {"trunk": n_trunk, "mtp": n_head, "total": n_trunk + n_head, "routed_experts": experts,
            "ple_table": ple, "active_per_token_approx": active,
            "bf16_bytes_approx": 2 * (n_trunk + n_head) + bufs}


# ---------------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------------
def load_tokens(corpus: pathlib.Path, tok_dir: pathlib.Path, max_mb: float, cache_dir: pathlib.Path):
    """(train uint16 array, test uint16 array): each document's ids followed by <|endoftext|>."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    key = hashlib.sha1()
    for p in (corpus, tok_dir / "tokenizer.json"):
        st = p.stat()
        key.update(f"{p.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode())
    key.update(str(max_mb).encode())
    cache = cache_dir / f"tokens_{key.hexdigest()[:12]}.npz"
    if cache.exists():
        z = np.load(cache)
        return z["train"], z["test"], eos
    t0 = time.time()
    texts = {"train": [], "test": []}
    n = 0
    with gzip.open(corpus, "rt", encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            texts[rec["split"]].append(rec["text"])
            n += len(rec["text"])
            if max_mb and n >= max_mb * 1e6:
                break
    out = {}
    for split, docs in texts.items():
        ids = []
        for i in range(0, len(docs), 256):
            for e in tok.encode_batch(docs[i:i + 256], add_special_tokens=False):
                ids.extend(e.ids)
                ids.append(eos)
        out[split] = np.asarray(ids, dtype=np.uint16)
    cache_dir.mkdir(parents=True, exist_ok=True)
    np.savez(cache, **out)
    print(f"tokenised {n / 1e6:.1f} MB: train {len(out['train'])} tokens, test {len(out['test'])} tokens "
          f"({time.time() - t0:.0f} s)", flush=True)
    return out["train"], out["test"], eos


def batch_windows(data: np.ndarray, starts, T: int, device):
    w = np.stack([data[s:s + T + 2] for s in starts]).astype(np.int64)
    return torch.from_numpy(w).to(device, non_blocking=True)


# ---------------------------------------------------------------------------------------------------------------------
# Forward with MTP
# ---------------------------------------------------------------------------------------------------------------------
class StackCapture:
    def __init__(self, model):
        self.x = None
        self.h = model.model.hyper_connection_mixer.register_forward_pre_hook(self._hook)

    def _hook(self, mod, args):
        self.x = args[0]


def forward_losses(model, head, cap, w, T, aux: bool):
    """w [B, T+2]: trunk input w[:, :T], trunk targets w[:, 1:T+1], MTP next ids w[:, 1:T+1], targets w[:, 2:T+2]."""
    inp, nxt, nxt2 = w[:, :T], w[:, 1:T + 1], w[:, 2:T + 2]
    out = model(input_ids=inp, use_cache=False, output_router_logits=aux)
    stacks = cap.x
    V = out.logits.shape[-1]
    ce = F.cross_entropy(out.logits.float().reshape(-1, V), nxt.reshape(-1))
    pos = torch.arange(T, device=w.device)
    hs = head(stacks, nxt, model.model.embed_tokens, pos)
    mlog = head.logits(hs, model.lm_head)
    mce = F.cross_entropy(mlog.float().reshape(-1, V), nxt2.reshape(-1))
    return out, ce, mce, mlog


@torch.no_grad()
def evaluate(model, head, cap, data, T, B, device, amp, max_tokens):
    model.eval(), head.eval()
    n_win = max(1, min((len(data) - 2) // T, max_tokens // T))
    starts = [i * T for i in range(n_win)]
    tot_ce = tot_mce = tot_acc = tot_acc_trunk = 0.0
    n = 0
    for i in range(0, len(starts), B):
        w = batch_windows(data, starts[i:i + B], T, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            out, ce, mce, mlog = forward_losses(model, head, cap, w, T, aux=False)
        k = w.shape[0] * T
        tot_ce += ce.item() * k
        tot_mce += mce.item() * k
        tot_acc += (mlog.argmax(-1) == w[:, 2:T + 2]).float().sum().item()
        tot_acc_trunk += (out.logits.argmax(-1) == w[:, 1:T + 1]).float().sum().item()
        n += k
    model.train(), head.train()
    return {"tokens": n, "next_token_loss": tot_ce / n, "next_token_ppl": math.exp(tot_ce / n),
            "trunk_top1_accuracy": tot_acc_trunk / n, "mtp_loss": tot_mce / n, "mtp_draft1_accuracy": tot_acc / n}


# ---------------------------------------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------------------------------------
def save_model(model, head, tok_dir: pathlib.Path, out_dir: pathlib.Path, eos_id: int, im_end_id: int):
    out_dir.mkdir(parents=True, exist_ok=True)
    m = model.to("cpu").to(torch.bfloat16)
    h = head.to("cpu").to(torch.bfloat16)
    m.config.mtp_num_hidden_layers = 1
    m.config.use_cache = True
    m.generation_config = GenerationConfig(eos_token_id=[eos_id, im_end_id], pad_token_id=eos_id,
                                           bos_token_id=None, do_sample=False)
    save_with_mtp(m, h, str(out_dir))
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1
    cfg["dtype"] = "bfloat16"
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for fn in os.listdir(tok_dir):
        if fn.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(tok_dir / fn, out_dir / fn)


def reload_check(out_dir: pathlib.Path, w: torch.Tensor):
    """Reload with transformers' from_pretrained + mtp_reference.load_head; logits finite, MTP tensors present."""
    from mtp_reference import load_head
    m = Qwen4ExpForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32).eval()
    h = load_head(str(out_dir), m.config, torch.float32)
    with torch.no_grad():
        lg = m(input_ids=w[:1, :64].cpu()).logits
    assert torch.isfinite(lg).all()
    return {"reloaded": True, "mtp_tensors": sum(1 for _ in h.state_dict())}


@torch.no_grad()
def sample(model, tok_dir, device, prompt, n=48):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids.to(device)
    model.eval()
    out = model.generate(ids, max_new_tokens=n, do_sample=False)
    model.train()
    return tok.decode(out[0, ids.shape[1]:])


# ---------------------------------------------------------------------------------------------------------------------
# --check-patch
# ---------------------------------------------------------------------------------------------------------------------
def antisymmetric_indexers(module):
    """Make indexer query head 2k+1 the negation of head 2k (RMS0 and RoPE are odd maps): then every block score
    is sum_k |q_2k . K| / sqrt(d) > 0, so no two blocks tie at the relu's zero. Exact ties are the only place
    where the two implementations may pick different blocks (torch.topk's order among equal values is
    unspecified), so this makes the model-level comparison well defined."""
    for m in module.modules():
        if isinstance(m, mq.Qwen4ExpTextQSAIndexer):
            D, W = m.index_head_dim, m.index_qk_proj.weight
            with torch.no_grad():
                for h in range(1, m.index_n_heads, 2):
                    W[h * D:(h + 1) * D] = -W[(h - 1) * D:h * D]


def check_patch(a) -> bool:
    torch.manual_seed(0)
    ok = True
    a = argparse.Namespace(**vars(a))
    # small geometry, random non-trivial weights, sequences well past budget + ratio - 1
    for hidden, T, B, budget, ratio, heads in ((64, 150, 2, 16, 4, 4), (48, 97, 3, 8, 2, 2), (64, 40, 1, 64, 4, 4)):
        a.hidden, a.idx_budget, a.idx_ratio, a.idx_heads = hidden, budget, ratio, heads
        a.heads, a.kv_heads, a.head_dim, a.idx_dim = 4, 2, 16, 16
        a.gdn_k_heads, a.gdn_v_heads, a.gdn_dim = 2, 4, 16
        a.experts, a.top_k, a.expert_dim, a.shared_dim, a.hc_rank = 8, 2, 32, 48, 16
        a.layers, a.attn_every, a.ngram_base, a.ngram_parts = 6, 3, 500, 2
        cfg = build_config(a, 512, 3)
        for impl in ("sdpa", "eager"):
            model, head = build_model(cfg, 1, impl)
            with torch.no_grad():
                for n, p in list(model.named_parameters()) + list(head.named_parameters()):
                    if n.endswith("norm.weight") or "layernorm" in n or "hc_norm" in n:
                        p.normal_(0, 0.3)
            antisymmetric_indexers(model), antisymmetric_indexers(head)
            model.eval(), head.eval()
            ids = torch.randint(0, 512, (B, T))
            ids[:, T // 3] = 3
            cap = StackCapture(model)
            res = {}
            for patched in (False, True):
                patch_indexer(patched)
                with torch.no_grad():
                    lg = model(input_ids=ids, use_cache=False).logits
                    hs = head(cap.x, ids, model.model.embed_tokens, torch.arange(T))
                    ml = head.logits(hs, model.lm_head)
                res[patched] = (lg, ml)
            # cached chunked decode also goes through the fast path (prefix masks with a past)
            with torch.no_grad():
                from transformers import DynamicCache
                pkv = DynamicCache(config=model.config)
                c1 = model(input_ids=ids[:, :T - 7], past_key_values=pkv, use_cache=True).logits
                c2 = model(input_ids=ids[:, T - 7:], past_key_values=pkv, use_cache=True).logits
                chunked = torch.cat([c1, c2], 1)
            patch_indexer(True)

            def rel(x, y):
                return ((x - y).abs().max() / y.abs().max()).item()

            r_trunk, r_mtp, r_chunk = rel(res[True][0], res[False][0]), rel(res[True][1], res[False][1]), \
                rel(chunked, res[False][0])
            good = r_trunk <= 1e-5 and r_mtp <= 1e-5 and r_chunk <= 1e-4
            ok &= good
            print(f"check-patch hidden {hidden} T {T} B {B} budget {budget} ratio {ratio} {impl}: rel diff trunk "
                  f"{r_trunk:.2e}, mtp {r_mtp:.2e}, chunked-cache {r_chunk:.2e} {'OK' if good else 'FAIL'}")
    # direct comparison of the selection masks on random inputs, with and without ties at zero
    for T, past, anti in ((130, 0, True), (9, 120, True), (1, 200, True), (130, 0, False), (40, 100, False)):
        cfg = build_config(a, 512, 3)
        idx = mq.Qwen4ExpTextQSAIndexer(cfg, 0).eval()
        with torch.no_grad():
            for p in idx.parameters():
                p.normal_(0, 0.5)
        if anti:
            antisymmetric_indexers(idx)
        Tk = past + T
        rot = mq.Qwen4ExpTextRotaryEmbedding(cfg)
        x = torch.randn(2, T, cfg.hidden_size)
        cos, sin = rot(x, torch.arange(Tk).view(1, 1, Tk).expand(3, 2, Tk))
        mask = (torch.arange(Tk).view(1, Tk) <= (past + torch.arange(T)).view(T, 1)).view(1, 1, T, Tk)
        mask = mask.expand(2, 1, T, Tk)

        class FakeCache:
            def __init__(self, prev):
                self.prev = prev

            def update_indexer(self, k, layer_idx):
                return torch.cat([self.prev, k], 1)

        prev = torch.randn(2, past, cfg.indexer_head_dim)
        _KEEP_SCORES[:] = [None]
        with torch.no_grad():
            m0 = _ORIGINAL_INDEXER_FORWARD(idx, x, (cos, sin), mask, FakeCache(prev) if past else None)
            m1 = _fast_indexer_forward(idx, x, (cos, sin), mask, FakeCache(prev) if past else None)
        scores = _KEEP_SCORES[0]
        _KEEP_SCORES[:] = []
        r = cfg.indexer_compress_ratio
        NB = scores.shape[-1]
        # per query: the sum of the selected blocks' scores (tie swaps leave it unchanged)
        sc = torch.nan_to_num(scores, neginf=0.0)

        def block_sum(m):
            blk = m[:, 0, :, : NB * r].reshape(2, T, NB, r).all(-1)
            return (sc * blk).sum(-1)

        same = torch.equal(m0, m1)
        rows = (m0 != m1).any(-1).sum().item()
        tie_only = torch.allclose(block_sum(m0), block_sum(m1), rtol=0, atol=1e-6) and \
            torch.equal(m0.sum(-1), m1.sum(-1))
        good = same if anti else tie_only
        ok &= good
        print(f"check-patch selection masks T {T} past {past} {'no ties' if anti else 'zero ties possible'}: "
              f"{'identical' if same else f'{rows} query rows differ, only by swapping equal-score blocks' if tie_only else 'DIFFERENT'} "
              f"({int(m0.sum())} selected) {'OK' if good else 'FAIL'}")
    print("check-patch:", "PASS" if ok else "FAIL", PATCH_STATS)
    return ok


# ---------------------------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("run")
    g.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    g.add_argument("--minutes", type=float, default=7.0, help="training time budget (evaluation and saving extra)")
    g.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: time budget only)")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--data-dir", default=str(REPO / "build/default_model"),
                   help="holds corpus.jsonl.gz and tokenizer/")
    g.add_argument("--corpus-mb", type=float, default=0, help="use only the first this many MB of the corpus")
    g.add_argument("--out", default=str(REPO / "build/default_model/model"))
    g.add_argument("--check-patch", action="store_true", help="verify the vectorised indexer and exit")
    g.add_argument("--no-patch", action="store_true", help="train with transformers' original (slow) indexer")
    g.add_argument("--tiny", action="store_true", help="tiny geometry and batch for a CPU smoke test")
    g.add_argument("--eval-tokens", type=int, default=300_000, help="held-out tokens evaluated at the end")
    g.add_argument("--log-every", type=int, default=20)
    t = ap.add_argument_group("optimisation")
    t.add_argument("--seq-len", type=int, default=256)
    t.add_argument("--batch", type=int, default=64)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--min-lr-frac", type=float, default=0.1)
    t.add_argument("--warmup", type=int, default=100)
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--clip", type=float, default=1.0)
    t.add_argument("--mtp-weight", type=float, default=0.5, help="lambda of the MTP cross-entropy")
    t.add_argument("--aux-coef", type=float, default=0.01, help="router load-balancing loss coefficient")
    m = ap.add_argument_group("geometry (defaults: the bundled default model)")
    m.add_argument("--hidden", type=int, default=320)
    m.add_argument("--layers", type=int, default=8)
    m.add_argument("--attn-every", type=int, default=4, help="layer i is sparse attention when (i+1) %% N == 0")
    m.add_argument("--heads", type=int, default=4)
    m.add_argument("--kv-heads", type=int, default=2)
    m.add_argument("--head-dim", type=int, default=64)
    m.add_argument("--partial-rotary", type=float, default=0.25)
    m.add_argument("--gdn-k-heads", type=int, default=4)
    m.add_argument("--gdn-v-heads", type=int, default=8)
    m.add_argument("--gdn-dim", type=int, default=48)
    m.add_argument("--experts", type=int, default=16)
    m.add_argument("--top-k", type=int, default=4)
    m.add_argument("--expert-dim", type=int, default=64)
    m.add_argument("--shared-dim", type=int, default=192)
    m.add_argument("--hc-count", type=int, default=4)
    m.add_argument("--hc-rank", type=int, default=32)
    m.add_argument("--ple-layer", type=int, default=2, help="one-based PLE layer id (must be a GDN layer)")
    m.add_argument("--ngram-base", type=int, default=4000)
    m.add_argument("--ngram-parts", type=int, default=4)
    m.add_argument("--idx-heads", type=int, default=4)
    m.add_argument("--idx-dim", type=int, default=32)
    m.add_argument("--idx-budget", type=int, default=64)
    m.add_argument("--idx-ratio", type=int, default=4)
    a = ap.parse_args(argv)
    if a.tiny:
        for k, v in dict(hidden=64, heads=2, kv_heads=1, head_dim=32, gdn_k_heads=2, gdn_v_heads=2, gdn_dim=16,
                         experts=8, top_k=2, expert_dim=32, shared_dim=64, hc_rank=8, ngram_base=1000,
                         idx_heads=2, idx_dim=16, idx_budget=16, seq_len=96, batch=4, warmup=10,
                         eval_tokens=4000, log_every=5).items():
            if getattr(a, k) == ap.get_default(k):
                setattr(a, k, v)
    return a


def main(argv=None):
    a = parse_args(argv)
    if a.check_patch:
        sys.exit(0 if check_patch(a) else 1)
    patch_indexer(not a.no_patch)
    device = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if a.device == "auto" else a.device))
    amp = device.type == "cuda"
    random.seed(a.seed), np.random.seed(a.seed), torch.manual_seed(a.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    t_start = time.time()
    data_dir = pathlib.Path(a.data_dir)
    tok_dir = data_dir / "tokenizer"
    out_dir = pathlib.Path(a.out)
    train, test, eos = load_tokens(data_dir / "corpus.jsonl.gz", tok_dir, a.corpus_mb, data_dir / "cache")
    tokj = json.loads((tok_dir / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tokj["added_tokens"]}
    vocab = max(max(tokj["model"]["vocab"].values()), max(added.values())) + 1
    im_end = added["<|im_end|>"]
    assert added["<|endoftext|>"] == eos
    t_data = time.time() - t_start

    cfg = build_config(a, vocab, eos)
    model, head = build_model(cfg, a.seed)
    sizes = count_params(model, head)
    print(f"params: {json.dumps(sizes)}", flush=True)
    print(f"layer types: {cfg.layer_types}", flush=True)
    model.to(device).train()
    head.to(device).train()
    cap = StackCapture(model)

    params = [(n, p) for n, p in model.named_parameters()] + [("mtp." + n, p) for n, p in head.named_parameters()]
    decay = [p for n, p in params if p.ndim >= 2 and "embed" not in n and "ngram_embedding" not in n]
    no_decay = [p for n, p in params if not (p.ndim >= 2 and "embed" not in n and "ngram_embedding" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=a.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=device.type == "cuda")
    T, B = a.seq_len, a.batch
    rng = np.random.default_rng(a.seed)
    budget = a.minutes * 60
    log = []
    step = 0
    tokens = 0
    t0 = time.time()
    step_times = []
    while True:
        elapsed = time.time() - t0
        if elapsed >= budget or (a.max_steps and step >= a.max_steps):
            break
        progress = min(1.0, elapsed / budget)
        if a.max_steps:
            progress = max(progress, step / a.max_steps)
        lr = a.lr * min(1.0, (step + 1) / a.warmup) * (
            a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress)))
        for g in opt.param_groups:
            g["lr"] = lr
        ts = time.time()
        starts = rng.integers(0, len(train) - T - 2, size=B)
        w = batch_windows(train, starts, T, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            out, ce, mce, _ = forward_losses(model, head, cap, w, T, aux=a.aux_coef > 0)
            loss = ce + a.mtp_weight * mce
            if out.aux_loss is not None:
                loss = loss + a.aux_coef * out.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_([p for _, p in params], a.clip)
        opt.step()
        step += 1
        tokens += B * T
        if step % a.log_every == 0 or step == 1:
            ce_v, mce_v = ce.item(), mce.item()  # syncs
            step_times.append(time.time() - ts)
            rec = {"step": step, "time_s": round(time.time() - t0, 1), "lr": lr, "loss": round(ce_v, 4),
                   "mtp_loss": round(mce_v, 4), "aux": round(out.aux_loss.item(), 4) if out.aux_loss is not None
                   else None, "grad_norm": round(gn.item(), 3), "tokens": tokens}
            log.append(rec)
            print(json.dumps(rec), flush=True)
    train_time = time.time() - t0
    final_train = log[-1] if log else None
    print(f"trained {step} steps, {tokens} tokens in {train_time:.0f} s "
          f"({tokens / max(train_time, 1e-9):.0f} tok/s)", flush=True)

    ev = evaluate(model, head, cap, test, T, B, device, amp, a.eval_tokens)
    print("held-out:", json.dumps(ev), flush=True)
    samples = {}
    for prompt in ("def fibonacci(n):\n", "import os\n\n\ndef "):
        try:
            samples[prompt] = sample(model, tok_dir, device, prompt)
        except Exception as e:  # a sample is only informative
            samples[prompt] = f"(failed: {e})"
    cap.h.remove()
    save_model(model, head, tok_dir, out_dir, eos, im_end)
    w = batch_windows(test, [0], T, torch.device("cpu"))
    rl = reload_check(out_dir, w)
    size = sum(f.stat().st_size for f in out_dir.iterdir() if f.is_file())
    report = {
        "settings": {k: v for k, v in vars(a).items()},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "indexer_patched": not a.no_patch, "indexer_patch_calls": dict(PATCH_STATS),
        "vocab_size": vocab, "eos_token_id": eos, "im_end_token_id": im_end,
        "layer_types": cfg.layer_types, "params": sizes,
        "data": {"train_tokens": int(len(train)), "test_tokens": int(len(test)), "prep_s": round(t_data, 1)},
        "steps": step, "tokens_seen": tokens, "epochs": tokens / max(1, len(train)),
        "train_time_s": round(train_time, 1), "tokens_per_s": round(tokens / max(train_time, 1e-9)),
        "step_time_s_logged": [round(x, 4) for x in step_times[-5:]],
        "final_train": final_train, "held_out": ev, "samples": samples, "reload": rl,
        "model_dir_bytes": size, "wall_time_s": round(time.time() - t_start, 1), "log": log,
    }
    (out_dir / "train_report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out_dir} ({size / 1e6:.1f} MB); wall {report['wall_time_s']} s", flush=True)


if __name__ == "__main__":
    main()
