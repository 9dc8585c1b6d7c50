#!/usr/bin/env python3
"""Tiny random qwen4_exp checkpoints WITH an MTP head (`mtp.*` tensors) and reference MTP logits.

Usage:
    python3 tools/make_mtp_fixtures.py --out tests/fixtures/models_mtp
    python3 tools/make_mtp_fixtures.py --out tests/fixtures/models_mtp --only mtp_f32_hc4

Reuses tools/make_fixtures.py (config building, randomisation, prompts, fragility probes, checkpoint writing,
reload checks) for the trunk, and tools/mtp_reference.py for the head. Each fixture directory holds everything a
tests/fixtures/models directory holds (config.json, safetensors, reference.json, logits.f32, logits_native.f32 for
bf16) plus the `mtp.*` tensors inside the checkpoint and `mtp_logits.f32`:

    mtp_logits.f32: little-endian float32 [(n-1) x vocab], n = len(prompt_ids). Row i = the head's logits for the
    row pairing the trunk's pre-final-mixer stack at position i with token prompt_ids[i+1] (its argmax drafts
    the token at position i+2). The head runs ONCE over rows 0..n-2 as one causal sequence at positions
    0..n-2 (its own attention + QSA indexer; no cache). fp32 computation (bf16 fixtures: on the bf16-rounded
    weights, as for logits.f32).

A fixture is redrawn (next attempt seed) when the trunk is fragile (make_fixtures.py's rules) or when the MTP layer
is: router top-k gap < 1e-4, indexer selection gap < 1e-4, or an MTP top-1/top-2 logit margin < 1e-3.
See tests/fixtures/models_mtp/README.md.
"""
from __future__ import annotations

import argparse
import copy
import os
import random
import shutil
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402
import mtp_reference as mr  # noqa: E402

L, S = mf.L, mf.S
MTP_MARGIN_MIN = 1e-3


def trunk_cfg(name, **changes):
    """The config of make_fixtures.py's fixture `name`, with `changes`."""
    (base,) = [f["cfg"] for f in mf.FIXTURES if f["name"] == name]
    return dict(base, **changes)


FIXTURES = [
    dict(
        name="mtp_f32_hc4",
        notes="fp32; hc_count 4; trunk as tiny_f32_hc4_ple1 (PLE [2], 2 sparse layers, GQA 4/2, head_dim 16, "
        "partial 0.25, but 4 indexer heads); MTP experts PER EXPERT (mtp.layers.0.mlp.experts.{e}.{gate,up,down}_proj.weight); single "
        "model.safetensors; 48-token prompt with EOS at 9, 10, 30",
        dtype="float32", layout="per_expert", mtp_layout="per_expert", vl=False, shard=None,
        prompt_len=48, eos_positions=[9, 10, 30],
        cfg=trunk_cfg("tiny_f32_hc4_ple1", indexer_n_heads=4),
    ),
    dict(
        name="mtp_f32_hc3_fused",
        notes="fp32; hc_count 3; FUSED experts in the trunk AND the MTP layer (mtp.layers.0.mlp.experts.gate_up_proj "
        "[E, 2I, H] gate rows first, mtp.layers.0.mlp.experts.down_proj [E, H, I]); output_gate_type silu; GQA 6/2, "
        "head_dim 8, partial 0.5; indexer 4 heads; PLE [1]; EOS = vocab-1 at 0, 17, 18; 52-token prompt",
        dtype="float32", layout="fused", mtp_layout="fused", vl=False, shard=None,
        prompt_len=52, eos_positions=[0, 17, 18],
        cfg=trunk_cfg("tiny_f32_hc3_ple2_fused_silu", layer_types=[L, L, S, L, S], ple_layer_ids=[1]),
    ),
    dict(
        name="mtp_bf16_hc4_sharded",
        notes="BF16 weights (trunk and mtp.*); logits.f32 / mtp_logits.f32 = fp32 forward of the bf16 values; "
        "hc_count 4; SHARDED checkpoint (mtp.* in its own last shard, index consistent); trunk experts per expert "
        "but MTP experts FUSED (mixed layout); GQA 8/1, head_dim 16, partial 0.5; 12 experts top-4; EOS at 20, 21",
        dtype="bfloat16", layout="per_expert", mtp_layout="fused", vl=False, shard="400KB",
        prompt_len=44, eos_positions=[20, 21],
        cfg=trunk_cfg("tiny_bf16_hc4", num_experts=12, ngram_vocab_size_base=800),
    ),
]


@torch.no_grad()
def mtp_logits(model, head, prompt):
    """Row i: head logits for (trunk stack at i, token prompt[i+1]); rows 0..n-2 as one sequence, positions 0..n-2."""
    n = len(prompt)
    stacks = mr.trunk_stacks(model, prompt)
    ids = torch.tensor([prompt[1:]])
    R = head(stacks[:, : n - 1], ids, model.model.embed_tokens, torch.arange(n - 1))
    return head.logits(R, model.lm_head)[0].float(), stacks


def make_fixture(spec: dict, out_root: str, seed: int, max_attempts: int = 40):
    name = spec["name"]
    out_dir = os.path.join(out_root, name)
    cfg = mf.build_config(spec["cfg"])
    eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, list) else cfg.eos_token_id
    is_bf16 = spec["dtype"] == "bfloat16"
    for attempt in range(max_attempts):
        aseed = mf.stable_seed(seed, name, attempt)
        torch.manual_seed(aseed)
        g = torch.Generator().manual_seed(aseed)
        model = mf.Qwen4ExpForCausalLM(copy.deepcopy(cfg)).eval()
        mf.randomize(model, g)
        head = mr.MtpHead(model.config).eval()
        mf.randomize(head, g)  # same per-name rules: norms N(0, 0.2), linears N(0, 1/sqrt(fan_in)), router, ...
        if is_bf16:
            with torch.no_grad():
                for p in list(model.parameters()) + list(head.parameters()):
                    p.copy_(p.to(torch.bfloat16).float())
        rng = random.Random(aseed)
        prompt = mf.make_prompt(rng, cfg.vocab_size, eos, spec["prompt_len"], spec["eos_positions"])

        lg = mf.logits_oneshot(model, prompt)
        with torch.no_grad():
            model.lm_head.weight.mul_(mf.LOGIT_STD_TARGET / float(lg.std()))
            if is_bf16:
                model.lm_head.weight.copy_(model.lm_head.weight.to(torch.bfloat16).float())

        probes = mf.Probes(model)
        ref = mf.logits_oneshot(model, prompt)
        gen, margins = mf.greedy(model, prompt, mf.N_GREEDY)
        lg_full = mf.logits_oneshot(model, (prompt + gen)[:-1])
        probes.close()
        hprobes = mf.Probes(head)
        mlog, stacks = mtp_logits(model, head, prompt)
        hprobes.close()
        top2 = torch.topk(mlog, 2, dim=-1).values
        mtp_margin = float((top2[:, 0] - top2[:, 1]).min())
        why = []
        if min(margins) < mf.GREEDY_MARGIN_MIN:
            why.append(f"greedy margin {min(margins):.2e}")
        if probes.router_gap < mf.ROUTER_GAP_MIN:
            why.append(f"router gap {probes.router_gap:.2e}")
        if probes.indexer_gap < mf.INDEXER_GAP_MIN:
            why.append(f"indexer gap {probes.indexer_gap:.2e}")
        if hprobes.router_gap < mf.ROUTER_GAP_MIN:
            why.append(f"MTP router gap {hprobes.router_gap:.2e}")
        if hprobes.indexer_gap < mf.INDEXER_GAP_MIN:
            why.append(f"MTP indexer gap {hprobes.indexer_gap:.2e}")
        if mtp_margin < MTP_MARGIN_MIN:
            why.append(f"MTP margin {mtp_margin:.2e}")
        if why:
            print(f"  [{name}] attempt {attempt} rejected: {', '.join(why)}", flush=True)
            continue
        break
    else:
        raise mf.FragileFixture(f"{name}: no robust fixture after {max_attempts} attempts")

    # --- self checks --------------------------------------------------------------------------------------------
    P = len(prompt)
    assert lg_full[P - 1:].argmax(-1).tolist() == gen, f"{name}: one-shot argmax != cached greedy"
    chunk_errs = {c: mf.rel_err(mf.logits_chunked(model, prompt, c), ref) for c in (5, 1)}
    for c, e in chunk_errs.items():
        assert e < mf.CHUNK_REL_TOL, f"{name}: chunk {c} rel err {e:.2e}"
    assert probes.pruned_queries > 0, f"{name}: the trunk indexer never pruned"
    assert hprobes.pruned_queries > 0, f"{name}: the MTP indexer never pruned"
    # the stacks reproduce the trunk logits through the final mixer
    with torch.no_grad():
        via = model.lm_head(model.model.hyper_connection_mixer(stacks))[0].float()
    assert mf.rel_err(via, ref) < 1e-6, f"{name}: trunk_stacks do not reproduce the logits"
    # causality of the head: a prefix of the rows gives the same logits
    k = (P - 1) // 2
    with torch.no_grad():
        Rk = head(stacks[:, :k], torch.tensor([prompt[1:k + 1]]), model.model.embed_tokens, torch.arange(k))
        pre = head.logits(Rk, model.lm_head)[0].float()
    prefix_err = mf.rel_err(pre, mlog[:k])
    assert prefix_err < 1e-5, f"{name}: MTP prefix rows differ: {prefix_err:.2e}"

    # --- write --------------------------------------------------------------------------------------------------
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    save_dtype = torch.bfloat16 if is_bf16 else torch.float32
    mf.save_checkpoint(model, spec, out_dir, save_dtype)
    mr.append_mtp_tensors(out_dir, mr.mtp_checkpoint_tensors(head, spec["mtp_layout"], save_dtype))
    mf.check_nonconstant(out_dir)
    n_mtp = len(mr.read_mtp_tensors(out_dir))
    assert n_mtp > 0

    reloaded = mf.reload_model(out_dir, spec, torch.float32, cfg)  # HF ignores mtp.* on load
    re32 = mf.rel_err(mf.logits_oneshot(reloaded, prompt), ref)
    assert re32 < mf.RELOAD_REL_TOL, f"{name}: reloaded trunk differs: {re32:.2e}"
    head2 = mr.load_head(out_dir, reloaded.config)
    mlog2, _ = mtp_logits(reloaded, head2, prompt)
    mre = mf.rel_err(mlog2, mlog)
    assert mre < mf.RELOAD_REL_TOL, f"{name}: MTP head reloaded from the checkpoint differs: {mre:.2e}"
    del reloaded, head2

    ref.numpy().astype("<f4").tofile(os.path.join(out_dir, "logits.f32"))
    mlog.numpy().astype("<f4").tofile(os.path.join(out_dir, "mtp_logits.f32"))
    amax = mlog.argmax(-1).tolist()
    hits = sum(1 for i in range(P - 2) if amax[i] == prompt[i + 2])
    reference = {
        "prompt_ids": prompt,
        "greedy_ids": gen,
        "vocab_size": cfg.vocab_size,
        "logits_file": "logits.f32",
        "mtp_logits_file": "mtp_logits.f32",
        "weights_dtype": spec["dtype"],
        "mtp_experts_layout": spec["mtp_layout"],
        "notes": spec["notes"],
    }
    native_err = None
    if is_bf16:
        native = mf.reload_model(out_dir, spec, torch.bfloat16, cfg)
        nat = mf.logits_oneshot(native, prompt)
        native_err = mf.rel_err(nat, ref)
        nat.numpy().astype("<f4").tofile(os.path.join(out_dir, "logits_native.f32"))
        reference["logits_native_file"] = "logits_native.f32"
        reference["native_vs_fp32_rel_err"] = native_err
        del native
    reference["mtp_rows"] = P - 1
    reference["mtp_positions"] = [0, P - 2]
    reference["mtp_argmax"] = amax
    reference["mtp_argmax_hits"] = hits
    reference["mtp_argmax_hit_rate"] = hits / max(1, P - 2)
    reference["mtp_last_row_argmax_equals_greedy0"] = amax[-1] == gen[0]
    reference["min_mtp_margin"] = mtp_margin
    reference["min_mtp_router_gap"] = hprobes.router_gap
    reference["min_mtp_indexer_gap"] = hprobes.indexer_gap
    reference["mtp_indexer_pruned_queries"] = hprobes.pruned_queries
    reference["mtp_logits_std"] = float(mlog.std())
    reference["mtp_prefix_rel_err"] = prefix_err
    reference["min_greedy_margin"] = min(margins)
    reference["min_router_gap"] = probes.router_gap
    reference["min_indexer_gap"] = probes.indexer_gap if probes.pruned_queries else None
    reference["indexer_pruned_queries"] = probes.pruned_queries
    reference["chunked_cache_rel_err"] = {str(k): v for k, v in chunk_errs.items()}
    reference["logits_std"] = float(ref.std())
    reference["generator"] = {"tool": "tools/make_mtp_fixtures.py", "seed": seed, "attempt": attempt,
                              "transformers": mf.transformers.__version__,
                              "torch": torch.__version__.split("+")[0]}
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        f.write(mf.dump_json(reference))

    size = mf.dir_bytes(out_dir)
    assert size <= mf.MAX_FIXTURE_BYTES, f"{name}: {size} bytes > {mf.MAX_FIXTURE_BYTES}"
    print(f"[{name}] {size / 1e6:.2f} MB, prompt {P}, {n_mtp} mtp tensors ({spec['mtp_layout']}), "
          f"MTP margin {mtp_margin:.2e}, MTP router gap {hprobes.router_gap:.2e}, MTP indexer gap "
          f"{hprobes.indexer_gap:.2e} ({hprobes.pruned_queries} pruned), hits {hits}/{P - 2}, "
          f"trunk greedy margin {min(margins):.2e}, attempt {attempt}", flush=True)
    return reference


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=20260101)
    ap.add_argument("--only", nargs="*")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for spec in FIXTURES:
        if args.only and spec["name"] not in args.only:
            continue
        make_fixture(spec, args.out, args.seed)


if __name__ == "__main__":
    main()
