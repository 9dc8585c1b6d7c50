#!/usr/bin/env python3
"""Trains the default model's tokenizer: a byte-level BPE (HF `tokenizers`) laid out like Qwen's tokenizer.json.

NFC normaliser; pre-tokenizer Sequence[Split(Qwen's regex, isolated), ByteLevel(no prefix space, no regex)];
ByteLevel decoder and post-processor. Special tokens: <|endoftext|> (document separator, model EOS and PLE n-gram
cut token), <|im_start|>, <|im_end|> (end of a chat turn; generation stops on it and on <|endoftext|>).
Writes tokenizer.json, tokenizer_config.json (ChatML chat_template) and special_tokens_map.json.

Run: python3 tools/default_model/train_tokenizer.py [--corpus build/default_model/corpus.jsonl.gz]
       [--out build/default_model/tokenizer] [--vocab-size 8192] [--max-mb 40]
"""
import argparse
import gzip
import json
import pathlib

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

REPO = pathlib.Path(__file__).resolve().parents[2]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2/Qwen3's pre-tokenizer pattern.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def iter_texts(corpus: pathlib.Path, max_bytes):
    n = 0
    with gzip.open(corpus, "rt", encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if rec["split"] != "train":
                continue
            yield rec["text"]
            n += len(rec["text"])
            if max_bytes and n >= max_bytes:
                return


def build(corpus, out, vocab_size, max_mb):
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False, special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), max_token_length=24)
    max_bytes = int(max_mb * 1e6) if max_mb else None
    tok.train_from_iterator(iter_texts(corpus, max_bytes), trainer=trainer)
    # Specials go after the learned vocabulary (as in Qwen's tokenizers): ids vocab_size-3 .. vocab_size-1.
    tok.add_special_tokens(SPECIAL)

    out.mkdir(parents=True, exist_ok=True)
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 additional_special_tokens=["<|im_start|>", "<|im_end|>"],
                                 model_max_length=32768, clean_up_tokenization_spaces=False)
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(out))
    # transformers 5 may keep the template in chat_template.jinja; also put it in tokenizer_config.json, where
    # older readers (and the engine) look for it.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["add_bos_token"] = False
    cfg["bos_token"] = None
    cfg["errors"] = "replace"
    cfg["split_special_tokens"] = False
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    ids = {t: tok.token_to_id(t) for t in SPECIAL}
    print(f"vocab {tok.get_vocab_size()} (specials {ids}) -> {out}")
    return ids


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default=str(REPO / "build/default_model/corpus.jsonl.gz"))
    ap.add_argument("--out", default=str(REPO / "build/default_model/tokenizer"))
    ap.add_argument("--vocab-size", type=int, default=8192, help="total vocabulary incl. the 3 special tokens")
    ap.add_argument("--max-mb", type=float, default=40, help="train on the first this many MB of the train split")
    args = ap.parse_args()
    build(pathlib.Path(args.corpus), pathlib.Path(args.out), args.vocab_size - len(SPECIAL), args.max_mb)

    from transformers import AutoTokenizer
    t = AutoTokenizer.from_pretrained(args.out)
    s = "def f(x):\n    return x ** 2  # über\n"
    assert t.decode(t.encode(s, add_special_tokens=False)) == s
    chat = t.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", chat
    print("round trip and chat template ok:", t.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False))


if __name__ == "__main__":
    main()
