#!/usr/bin/env python3
"""Builds the tokenizer test corpus: tests/fixtures/tokenizer/corpus.bin plus corpus_sources.json.

The corpus is a list of documents (raw bytes, some deliberately invalid UTF-8). Material:
  * Python standard library sources and the pydoc topic texts (PSF License) of the running interpreter;
  * hand-written multilingual sentences, emoji, combining marks, whitespace/digit runs, special tokens
    inside text and invalid UTF-8 (in this file, written for this project);
  * deterministic pseudo-random letter soup per script (seeded), to reach many code points.

Format of corpus.bin: for each document, a little-endian uint32 byte length followed by the bytes.
Run: python3 tools/tokenizer/build_corpus.py  (then make_tokenizer_fixtures.py)
"""
import json
import pathlib
import random
import struct
import sys
import sysconfig
import unicodedata

REPO = pathlib.Path(__file__).resolve().parents[2]
OUT_DIR = REPO / "tests" / "fixtures" / "tokenizer"
MAX_DOC_BYTES = 12_000

STDLIB_FILES = [
    "argparse.py", "ast.py", "base64.py", "bisect.py", "calendar.py", "codecs.py", "colorsys.py",
    "contextlib.py", "copy.py", "csv.py", "dataclasses.py", "difflib.py", "enum.py", "fnmatch.py",
    "fractions.py", "functools.py", "gettext.py", "glob.py", "heapq.py", "hmac.py", "ipaddress.py",
    "keyword.py", "locale.py", "numbers.py", "operator.py", "pprint.py", "queue.py", "random.py",
    "sched.py", "secrets.py", "shlex.py", "statistics.py", "string.py", "textwrap.py", "tokenize.py",
    "typing.py", "uuid.py", "weakref.py", "json/decoder.py", "json/encoder.py",
]

MULTILINGUAL = [
    # Latin script, several languages.
    "The quick brown fox jumps over the lazy dog; it's what we'd've done, isn't it? I'LL SEE.",
    "Voilà l'été : où est la cœur de l'œuvre ? « Ça va », dit-il, très ému.",
    "Über die Brücke gehen Fußgänger; die Straße heißt Äußere Grünstraße Nr. 17.",
    "Tiếng Việt có nhiều dấu: người, được, những, thuở ấy, phở bò.",
    "Zażółć gęślą jaźń — pchnąć w tę łódź jeża lub ośm skrzyń fig.",
    "Pijamalı hasta yağız şoföre çabucak güvendi; İstanbul'da ılık bir gün.",
    "¿Dónde está la estación? ¡Mañana iremos a Bogotá con Íñigo!",
    # Cyrillic.
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "Чуєш їх, доцю, га? Кумедна ж ти, прощайся без ґольфів!",
    # Greek.
    "Ξεσκεπάζω την ψυχοφθόρα βδελυγμία. Η γλώσσα μου έδωσαν ελληνική.",
    # Arabic and Hebrew (right to left).
    "نص حكيم له سر قاطع وذو شأن عظيم مكتوب على ثوب أخضر ومغلف بجلد أزرق.",
    "דג סקרן שט בים מאוכזב ולפתע מצא חברה. שלום עולם!",
    # Indic scripts.
    "ऋषियों को सताने वाले दुष्ट राक्षसों के राजा रावण का सर्वनाश करने वाले विष्णुवतार भगवान श्रीराम।",
    "আমি বাংলায় গান গাই; আমার সোনার বাংলা, আমি তোমায় ভালোবাসি।",
    "யாமறிந்த மொழிகளிலே தமிழ்மொழி போல் இனிதாவது எங்கும் காணோம்.",
    # Southeast Asian scripts without spaces.
    "เป็นมนุษย์สุดประเสริฐเลิศคุณค่า กว่าบรรดาฝูงสัตว์เดรัจฉาน",
    # Caucasus.
    "ქართული ენა ერთ-ერთი უძველესი ენაა. Հայերենը գեղեցիկ լեզու է։",
    # CJK.
    "我能吞下玻璃而不伤身体。今天天气很好，我们去公园散步吧！",
    "いろはにほへと ちりぬるを わかよたれそ つねならむ。カタカナとひらがな、漢字。",
    "다람쥐 헌 쳇바퀴에 타고파. 한국어 문장입니다: 안녕하세요!",
    # Ethiopic and others.
    "ሰማይ አይታረስ ንጉሥ አይከሰስ። ᚠᛇᚻ᛫ᛒᛦᚦ ᛫ᚠᚱᚩᚠᚢᚱ ᛫ᚠᛁᚱᚪ",
]

EMOJI = [
    "👨‍👩‍👧‍👦 family, 👩🏽‍💻 coder, 🏳️‍🌈 flag, 🧑🏿‍🤝‍🧑🏻 handshake, 👍🏻👍🏼👍🏽👍🏾👍🏿 thumbs.",
    "❤️‍🔥 heart on fire, 🫱🏾‍🫲🏼, 🇫🇷🇯🇵🇺🇸 flags, keycaps 1️⃣#️⃣*️⃣, 🏴󠁧󠁢󠁳󠁣󠁴󠁿 Scotland.",
    "😀😃😄😁😆😅😂🤣🥲☺️😊😇🙂🙃😉😌😍🥰😘 — emoji run without spaces!!!",
]

COMBINING = [
    # Decomposed accents: NFC composes these (Qwen normalises, DeepSeek does not).
    "Cafe\u0301 na\u0131\u0308ve re\u0301sume\u0301 A\u030a ångström vs A\u030angstro\u0308m",
    "Z\u0351\u0305a\u0352\u0353l\u0354g\u0355o\u0356 t\u0357e\u0358x\u0359t\u035a with stacked marks",
    "Hangul jamo \u1100\u1161\u11a8 and precomposed \uac01; Devanagari \u0915\u093c vs \u0958.",
    "Vietnamese decomposed: Vie\u0323\u0302t Nam, ngu\u031bo\u031b\u0300i.",
]

WHITESPACE_AND_DIGITS = [
    "x" + " " * 40 + "y\t\t\t\tz\n\n\n\n\n" + "   \n   \n\t \r\n\r\n" + " " * 17,
    "1234567890" * 12 + " 3.14159265358979 1,000,000 0x7fffffff 2024-06-01T12:00:00Z",
    "\u00a0non-breaking\u2003em space\u3000ideographic\u2028line sep\u2029para sep\u0085nel\u000bvt\u000cff",
    "digits in scripts: ٠١٢٣٤٥٦٧٨٩ ०१२३४५६७८९ ໐໑໒ ①②③ ½ ¾ Ⅻ",
    "    def f(x):\n        return x  \n\n\n    \t# trailing   \n",
]

SPECIAL_IN_TEXT = [
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text <|im_end|><|im_end|>  <think>\nreason</think>\n\nanswer",
    "partial <|im_sta rt|> and <|im_start and <|endoftext| and </think > stay text",
    "<｜begin▁of▁sentence｜>system<｜User｜>Hello<｜Assistant｜>Hi!<｜end▁of▁sentence｜>",
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{}\n```",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call><|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>",
]

INVALID_UTF8 = [
    b"lone continuation \x80\x81 bytes",
    b"truncated two-byte \xc3 then ascii",
    b"truncated four-byte \xf0\x9f\x98 then ascii and at end \xe2\x82",
    b"overlong \xc0\xaf and \xe0\x80\xaf, surrogate \xed\xa0\x80, out of range \xf4\x90\x80\x80 \xf5\xff\xfe",
    b"mixed valid \xc3\xa9 invalid \xa9 valid \xe2\x82\xac invalid \xe2\x28\xa1 end",
    b"\xff" * 10 + b" bytes " + b"\x80" * 7,
]

# Unicode ranges for the seeded letter soup: one block per script.
SCRIPT_RANGES = {
    "latin_ext": (0x0100, 0x024F), "greek": (0x0370, 0x03FF), "cyrillic": (0x0400, 0x04FF),
    "armenian": (0x0531, 0x058A), "hebrew": (0x05D0, 0x05EA), "arabic": (0x0620, 0x064A),
    "devanagari": (0x0900, 0x097F), "bengali": (0x0980, 0x09FF), "tamil": (0x0B80, 0x0BFF),
    "thai": (0x0E01, 0x0E5B), "georgian": (0x10A0, 0x10FF), "hangul": (0xAC00, 0xD7A3),
    "hiragana": (0x3041, 0x3096), "katakana": (0x30A1, 0x30FA), "cjk": (0x4E00, 0x9FFF),
    "ethiopic": (0x1200, 0x137F), "math_symbols": (0x2200, 0x22FF), "emoji": (0x1F300, 0x1F64F),
}


def chunks(data, size):
    """Splits bytes into pieces of at most `size`, cutting only after a newline where possible."""
    pieces = []
    while data:
        cut = data.rfind(b"\n", 0, size) + 1 if len(data) > size else len(data)
        if cut <= 0:
            cut = size
        pieces.append(data[:cut])
        data = data[cut:]
    return pieces


def letter_soup(rng, low, high, words):
    assigned = [c for c in range(low, high + 1) if unicodedata.category(chr(c)) != "Cn"]
    out = []
    for _ in range(words):
        out.append("".join(chr(rng.choice(assigned)) for _ in range(rng.randint(1, 9))))
        out.append(rng.choice([" ", " ", " ", ", ", ". ", "\n", "  ", "-", "'s ", "123 "]))
    return "".join(out)


def main():
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    documents, sources = [], []

    def add(data, source):
        for piece in chunks(data, MAX_DOC_BYTES):
            documents.append(piece)
            sources.append(source)

    for name in STDLIB_FILES:
        add((stdlib / name).read_bytes(), f"python-stdlib:{name}")
    topics = {}
    exec(compile((stdlib / "pydoc_data" / "topics.py").read_text(), "topics.py", "exec"), topics)
    for key in sorted(topics["topics"])[:24]:
        add(topics["topics"][key].encode(), f"python-pydoc-topics:{key}")

    hand_written = MULTILINGUAL + EMOJI + COMBINING + WHITESPACE_AND_DIGITS + SPECIAL_IN_TEXT
    for text in hand_written:
        add(text.encode(), "hand-written")
    add("\n".join(hand_written).encode() * 3, "hand-written:joined")
    for data in INVALID_UTF8:
        add(data, "hand-written:invalid-utf8")

    rng = random.Random(20240601)
    for script, (low, high) in SCRIPT_RANGES.items():
        add(letter_soup(rng, low, high, 600).encode(), f"seeded-letter-soup:{script}")

    with open(OUT_DIR / "corpus.bin", "wb") as out:
        for doc in documents:
            out.write(struct.pack("<I", len(doc)))
            out.write(doc)
    manifest = {
        "python": sys.version.split()[0],
        "stdlib": "Python standard library sources and pydoc topics, PSF License 2.0",
        "documents": len(documents),
        "bytes": sum(map(len, documents)),
        "sources": sources,
    }
    (OUT_DIR / "corpus_sources.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{len(documents)} documents, {manifest['bytes']} bytes")


if __name__ == "__main__":
    main()
