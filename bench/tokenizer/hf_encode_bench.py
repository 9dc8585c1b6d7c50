#!/usr/bin/env python3
"""Encode throughput of HF `tokenizers` on the same corpus, single thread; prints one JSON object.

Each document is encoded with Tokenizer.encode (one call per document, like the C++ side); the lossy UTF-8
decoding of the corpus bytes happens before timing. Best of REPEATS runs after one warm-up run.
"""
import json
import os
import struct
import sys
import time

os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
import tokenizers  # noqa: E402  (the environment must be set first)


def main(tokenizer_dir, corpus_path, repeats):
    data = open(corpus_path, "rb").read()
    documents, offset = [], 0
    while offset < len(data):
        (length,) = struct.unpack_from("<I", data, offset)
        documents.append(data[offset + 4 : offset + 4 + length])
        offset += 4 + length
    texts = [doc.decode("utf-8", errors="replace") for doc in documents]
    tokenizer = tokenizers.Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    best, ids = float("inf"), 0
    for _ in range(repeats):
        start = time.perf_counter()
        ids = sum(len(tokenizer.encode(text).ids) for text in texts)
        best = min(best, time.perf_counter() - start)
    size = sum(map(len, documents))
    print(json.dumps({"bytes": size, "ids": ids, "seconds": best, "mb_per_s": size / best / 1e6,
                      "tokenizers": tokenizers.__version__}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
