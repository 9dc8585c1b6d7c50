#!/usr/bin/env python3
"""Expected token ids from HF `tokenizers` (versions pinned in requirements.txt) for the corpus.

For each tokenizer NAME in /work/shared/data/tokenizers (or $VAVILOV_TOKENIZERS) writes
tests/fixtures/tokenizer/NAME.ids: for each corpus document a little-endian uint32 count and that many uint32
ids, from `Tokenizer.encode(text, add_special_tokens=True)` where text is the document decoded as UTF-8 with
errors="replace" (the documented treatment of invalid UTF-8). NAME.decoded.json records, per document, the
FNV-1a 64 hash of `Tokenizer.decode(ids)` encoded as UTF-8 (with and without skip_special_tokens), so decoding
is checked against HF too.
Run after build_corpus.py.
"""
import json
import os
import pathlib
import struct

import tokenizers

REPO = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "tokenizer"
TOKENIZERS = pathlib.Path(os.environ.get("VAVILOV_TOKENIZERS", REPO.parent / "shared" / "data" / "tokenizers"))
NAMES = ["qwen3", "deepseek_v3"]

# Short cases whose ids a failing test can print whole.
EDGE_CASES = [
    "", " ", "  ", "\n", "Hello world", "hello  world", "   leading and trailing   ", "a\r\nb\n\n\nc",
    "don't DON'T we'll I'M", "12345678901234567890", "3.14 and 1e-9", "<|im_start|>", "<|im_start|><|im_end|>",
    " <|im_end|> ", "<|im_start|>user\nhi<|im_end|>", "<think>\n\n</think>\n\n", "<|im_start", "<<|im_end|>>",
    "<｜User｜>hi<｜Assistant｜>", "<｜begin▁of▁sentence｜>", "caf\u00e9 cafe\u0301", "\u212b \u00c5 A\u030a",
    "日本語のテキスト123", "中文和English混合", "👩🏽‍💻👨‍👩‍👧‍👦", "\ufffd\ufffd", "\u0000nul\u0001", "\t\t\tx",
    "é" * 50, "a" * 300, " " * 100 + "x", "\u00a0\u2003\u3000", "٠١٢٣ १२३", "x\u0300\u0301\u0302\u0303",
]


def read_corpus():
    data = (FIXTURES / "corpus.bin").read_bytes()
    documents, offset = [], 0
    while offset < len(data):
        (length,) = struct.unpack_from("<I", data, offset)
        documents.append(data[offset + 4 : offset + 4 + length])
        offset += 4 + length
    return documents


def fnv1a64(data):
    value = 0xCBF29CE484222325
    for byte in data:
        value = ((value ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return value


def main():
    assert tokenizers.__version__ == "0.23.3", tokenizers.__version__
    documents = read_corpus()
    for name in NAMES:
        tokenizer = tokenizers.Tokenizer.from_file(str(TOKENIZERS / name / "tokenizer.json"))
        hashes, skip_hashes, total = [], [], 0
        with open(FIXTURES / f"{name}.ids", "wb") as out:
            for doc in documents:
                ids = tokenizer.encode(doc.decode("utf-8", errors="replace")).ids
                out.write(struct.pack(f"<I{len(ids)}I", len(ids), *ids))
                hashes.append(f"{fnv1a64(tokenizer.decode(ids, skip_special_tokens=False).encode()):016x}")
                skip_hashes.append(f"{fnv1a64(tokenizer.decode(ids, skip_special_tokens=True).encode()):016x}")
                total += len(ids)
        meta = {"tokenizers": tokenizers.__version__, "documents": len(documents), "ids": total,
                "decoded_fnv1a64": hashes,
                "decoded_skip_special_fnv1a64": skip_hashes}
        (FIXTURES / f"{name}.decoded.json").write_text(json.dumps(meta) + "\n")
        print(f"{name}: {total} ids")
    edge_cases = []
    for text in EDGE_CASES:
        case = {"text": text}
        for name in NAMES:
            tokenizer = tokenizers.Tokenizer.from_file(str(TOKENIZERS / name / "tokenizer.json"))
            case[name] = tokenizer.encode(text).ids
        edge_cases.append(case)
    lines = ",\n".join(json.dumps(case, ensure_ascii=False) for case in edge_cases)
    (FIXTURES / "edge_cases.json").write_text(f"[\n{lines}\n]\n")


if __name__ == "__main__":
    main()
