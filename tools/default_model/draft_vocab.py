#!/usr/bin/env python3
"""Ranks the bundled model's token ids by frequency in the training split of its corpus, for the MTP draft head.

The engine's CPU draft head scores only the most frequent ids (src/engine/backend.cpp, docs/MTP.md): a draft only
proposes, the trunk verifies every draft exactly, so a smaller draft vocabulary can cost acceptance, never
correctness. Held-out documents are not counted. Writes <model>/draft_vocab.json: every id seen in training, most
frequent first (ties by id), with the count of each.
    python3 tools/default_model/draft_vocab.py [--corpus build/default_model/corpus.jsonl.gz]
        [--model models/flash-next-mini]
"""
import argparse
import collections
import gzip
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", default=os.path.join(ROOT, "build", "default_model", "corpus.jsonl.gz"))
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "flash-next-mini"))
    args = ap.parse_args()
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    texts = []
    with gzip.open(args.corpus, "rt") as f:
        for line in f:
            document = json.loads(line)
            if document["split"] == "train":
                texts.append(document["text"])
    counts = collections.Counter()
    for encoding in tokenizer.encode_batch(texts):
        counts.update(encoding.ids)
    ranked = sorted(counts, key=lambda i: (-counts[i], i))
    result = {"what": "token ids by frequency in the training split (most frequent first); the MTP draft head "
                      "scores a prefix of this list",
              "corpus": os.path.basename(args.corpus), "documents": len(texts), "tokens": sum(counts.values()),
              "token_ids": ranked, "counts": [counts[i] for i in ranked]}
    path = os.path.join(args.model, "draft_vocab.json")
    with open(path, "w") as f:
        json.dump(result, f)
        f.write("\n")
    print(f"wrote {path}: {len(ranked)} ids from {result['tokens']} tokens in {len(texts)} documents")


if __name__ == "__main__":
    main()
