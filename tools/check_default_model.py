#!/usr/bin/env python3
"""The engine on the bundled model against transformers (trunk) and the PyTorch MTP reference (head).

Runs HF in fp32 on the bf16 weights (upcast), over a fixed code prompt long enough that the QSA indexer prunes,
and compares `vavilov logits` and `vavilov logits --mtp` with it (max|Δ| / max|ref|). Exits non-zero above the bound.
    python3 tools/check_default_model.py --binary build/vavilov [--model models/flash-next-mini]
"""
import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import Qwen4ExpForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mtp_reference import load_head, trunk_stacks  # noqa: E402

PROMPT = '''import os


def find_files(root, suffix):
    """Yield every path below root whose name ends with suffix."""
    for directory, _, names in os.walk(root):
        for name in names:
            if name.endswith(suffix):
                yield os.path.join(directory, name)


def count_lines(paths):
    total = 0
    for path in paths:
        with open(path) as handle:
            total += sum(1 for _ in handle)
    return total
'''
TOLERANCE = 1e-4  # fp32 engine vs fp32 HF on the same (bf16-valued) weights


def break_topk_ties_by_index():
    """A trained model's QSA block scores (sums of ReLUs) are often exactly 0, and transformers leaves the choice
    among equal scores at the selection boundary to torch.topk, whose order is unspecified. The engine keeps the
    lower block index (docs/ARCHITECTURE.md); this makes the reference do the same for 1-D top-k (the indexer's)."""
    original = torch.Tensor.topk

    def stable_topk(self, k, dim=-1, largest=True, sorted=True):
        if self.dim() != 1 or not largest:
            return original(self, k, dim, largest, sorted)
        order = torch.sort(self, descending=True, stable=True)
        return torch.return_types.topk((order.values[:k], order.indices[:k]))

    torch.Tensor.topk = stable_topk


def engine(binary, model, ids, out, *extra):
    subprocess.run([binary, "logits", "--model", model, "--ids", ",".join(map(str, ids)), "--out", out, *extra],
                   check=True)
    return np.fromfile(out, dtype=np.float32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", required=True)
    ap.add_argument("--model", default=os.path.join(os.path.dirname(__file__), "..", "models", "flash-next-mini"))
    args = ap.parse_args()
    torch.manual_seed(0)
    break_topk_ties_by_index()
    ids = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json")).encode(PROMPT).ids
    model = Qwen4ExpForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    head = load_head(args.model, model.config).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        trunk = model(x).logits[0].numpy()
        stacks = trunk_stacks(model, x)
        positions = torch.arange(len(ids) - 1)[None]
        mtp = head.logits(head(stacks[:, :-1], x[:, 1:], model.model.embed_tokens, positions), model.lm_head)[0]
    mtp = mtp.numpy()
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "logits.f32")
        for name, want, extra in [("trunk", trunk, ()), ("trunk --chunk 7", trunk, ("--chunk", "7")),
                                  ("mtp", mtp, ("--mtp",))]:
            got = engine(args.binary, args.model, ids, out, *extra).reshape(want.shape)
            error = float(np.abs(got - want).max() / np.abs(want).max())
            agree = float((got.argmax(-1) == want.argmax(-1)).mean())
            ok = error <= TOLERANCE
            failed |= not ok
            print(f"{'ok  ' if ok else 'FAIL'} {name}: {len(ids)} tokens, rel err {error:.2e} (tol {TOLERANCE:g}), "
                  f"argmax agreement {agree:.3f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
