#!/usr/bin/env python3
"""Builds a model directory for server tests: a tiny random fixture checkpoint (linked, not copied) plus a small
byte-level BPE tokenizer trained here with HF `tokenizers`, sized to the checkpoint's vocabulary, and a ChatML chat
template with tools and thinking.

Besides ordinary BPE tokens the vocabulary holds a few whole-markup tokens (listed in markup.json). A random model
never writes tool-call markup by itself; a request with logit_bias on one of these ids makes it emit exactly that
text, so tests can drive tool-call and reasoning parsing end to end through the public API.

Usage: make_test_model.py FIXTURE_DIR OUT_DIR
"""
import json
import os
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = ["<|endoftext|>", "<|im_end|>", "<|im_start|>"]  # ids 0, 1, 2: the fixtures' EOS id is 1

MARKUP = {
    "tool_json": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
    "tool_xml": "<tool_call>\n<function=get_weather>\n<parameter=city>\nBerlin\n</parameter>\n"
                "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
    "think": "<think>The user wants a greeting.</think>\n\nHello there!",
    "repeat": "Zq!",
    "emoji": "caf\u00e9 \u2615 ok",
}

CHAT_TEMPLATE = r"""{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- "# Tools\n\nYou may call one or more functions. Signatures:\n<tools>" }}
{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\n</tools>\n\nReturn each call in <tool_call></tool_call> tags.<|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' + (message.content or '') }}
{%- for tool_call in message.tool_calls or [] %}
{{- '\n<tool_call>\n{"name": "' + tool_call.function.name + '", "arguments": ' + (tool_call.function.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}"""

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello, world! How are you today?",
    "def main():\n    print('hello')\n    return 0\n",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "You are a helpful assistant. Answer the question in one sentence, please.",
    "0123456789 !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~ ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz",
] * 50


def vocab_size_of(fixture):
    with open(os.path.join(fixture, "config.json")) as f:
        config = json.load(f)
    return config.get("text_config", config)["vocab_size"]


def build_tokenizer(vocab_size):
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(MARKUP), special_tokens=SPECIAL,
                                  show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.add_tokens(list(MARKUP.values()))
    if tokenizer.get_vocab_size() != vocab_size:
        sys.exit(f"tokenizer has {tokenizer.get_vocab_size()} ids, the model {vocab_size}")
    return tokenizer


def main():
    fixture, out = os.path.abspath(sys.argv[1]), sys.argv[2]
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(fixture):
        if name.endswith(".json") and name != "config.json" or name.endswith(".f32"):
            continue
        target = os.path.join(out, name)
        if not os.path.exists(target):
            os.symlink(os.path.join(fixture, name), target)
    tokenizer = build_tokenizer(vocab_size_of(fixture))
    tokenizer.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
                   "chat_template": CHAT_TEMPLATE}, f, indent=1)
    markup = {key: tokenizer.token_to_id(text) for key, text in MARKUP.items()}
    with open(os.path.join(out, "markup.json"), "w") as f:
        json.dump({"ids": markup, "text": MARKUP}, f, indent=1)


if __name__ == "__main__":
    main()
