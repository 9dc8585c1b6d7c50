#!/usr/bin/env python3
"""Lists the code points whose NFC behaviour in HF `tokenizers` differs from the current Unicode tables.

HF's NFC normaliser (crate unicode-normalization-alignments) carries old Unicode tables: combining marks encoded
later are plain starters to it. Vavilov's normaliser reproduces that with the ranges printed here (pasted into
src/tokenizer/normalizer.cpp). Python's unicodedata stands in for the current tables (utf8proc agrees on these).
"""
import unicodedata

import tokenizers

nfc = tokenizers.normalizers.NFC()
# A mark of combining class 1 after the code point reveals its class; U+0301 and "a" reveal compositions.
different = [cp for cp in range(0x110000) if not 0xD800 <= cp < 0xE000 and any(
    nfc.normalize_str(probe) != unicodedata.normalize("NFC", probe)
    for probe in ("x" + chr(cp) + "\u0334", chr(cp) + "\u0301", "a" + chr(cp), chr(cp)))]
ranges = []
for cp in different:
    if ranges and ranges[-1][1] == cp - 1:
        ranges[-1][1] = cp
    else:
        ranges.append([cp, cp])
print(f"Unicode {unicodedata.unidata_version}, {len(different)} code points")
print(", ".join(f"{{0x{low:04X}, 0x{high:04X}}}" for low, high in ranges))
