#!/usr/bin/env python3
"""Expected chat-template renderings from transformers' apply_chat_template (versions in requirements.txt).

Writes tests/fixtures/tokenizer/chat_cases.json: for each conversation (messages, tools, options) and each real
tokenizer, the rendered text, or the error transformers raised (then Vavilov must raise one too), plus the
token ids of the rendered text for the first few cases. Those come from HF `tokenizers` on tokenizer.json, as
apply_chat_template(tokenize=True) would give, except that transformers 5.17 loads DeepSeek-V3's tokenizer as a
Metaspace LlamaTokenizer and so tokenizes it differently from its own tokenizer.json.
"""
import json
import os
import pathlib

import tokenizers
import transformers

REPO = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "tokenizer"
TOKENIZERS = pathlib.Path(os.environ.get("VAVILOV_TOKENIZERS", REPO.parent / "shared" / "data" / "tokenizers"))
NAMES = ["qwen3", "deepseek_v3"]
IDS_FOR_FIRST_CASES = 6

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city. Température actuelle — °C.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. \"Paris\""},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7.5, "nullable": None, "strict": True},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {"name": "search", "description": "Search the web\nfor pages.", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "top_k": {"type": "number", "default": 0.5}}}},
}


def user(text):
    return {"role": "user", "content": text}


def assistant(text, **extra):
    return {"role": "assistant", "content": text, **extra}


def system(text):
    return {"role": "system", "content": text}


def tool(text):
    return {"role": "tool", "content": text}


def call(name, arguments, wrap=True):
    function = {"name": name, "arguments": arguments}
    return {"type": "function", "function": function} if wrap else function


def cases():
    weather_call_str = call("get_weather", json.dumps({"city": "Paris", "days": 2}))
    weather_call_obj = call("get_weather", {"city": "Zürich", "days": 3, "ratio": 1.0, "big": 1e20, "small": 0.0001})
    yield ("single_user", [user("Hello!")], None, {})
    yield ("system_and_user", [system("You are a helpful assistant."), user("What is 2+2?")], None, {})
    yield ("multi_turn", [user("Hi"), assistant("Hello! How can I help?"), user("Tell me a joke.")], None, {})
    yield ("no_generation_prompt", [user("Hi"), assistant("Hello there.")], None, {"add_generation_prompt": False})
    yield ("thinking_disabled", [user("Quick answer: capital of France?")], None, {"enable_thinking": False})
    yield ("thinking_enabled", [user("Think about it: 17*23?")], None, {"enable_thinking": True})
    yield ("reasoning_content_field", [
        user("Why is the sky blue?"),
        assistant("Rayleigh scattering.", reasoning_content="Short wavelengths scatter more.\n"),
        user("And sunsets?")], None, {})
    yield ("inline_think_in_content", [
        user("2+2?"), assistant("<think>\nSimple arithmetic.\n</think>\n\n4"), user("3+3?")], None, {})
    yield ("last_assistant_with_think", [
        user("2+2?"), assistant("<think>\nadd\n</think>\n\nIt is 4.")], None, {"add_generation_prompt": False})
    yield ("reasoning_content_none", [
        user("hi"), assistant("hello", reasoning_content=None), user("bye")], None, {})
    yield ("tools_only", [user("Weather in Paris?")], [WEATHER_TOOL], {})
    yield ("tools_with_system", [system("Be brief."), user("Weather in Paris?")], [WEATHER_TOOL, SEARCH_TOOL], {})
    yield ("tool_call_string_arguments", [
        user("Weather in Paris?"), assistant(None, tool_calls=[weather_call_str]), tool('{"temp": 21}'),
        assistant("It is 21 °C in Paris.")], [WEATHER_TOOL], {"add_generation_prompt": False})
    yield ("tool_call_object_arguments", [
        user("Weather in Zürich?"), assistant("", tool_calls=[weather_call_obj]), tool("{\"temp\": -3.5}")],
        [WEATHER_TOOL], {})
    yield ("two_tool_calls_two_responses", [
        user("Weather in Paris and search news"),
        assistant(None, tool_calls=[weather_call_str, call("search", json.dumps({"query": "news"}))]),
        tool("sunny"), tool("no news")], [WEATHER_TOOL, SEARCH_TOOL], {})
    yield ("tool_call_with_content", [
        user("Weather?"), assistant("Let me check.", tool_calls=[weather_call_obj]), tool("rain")], [WEATHER_TOOL], {})
    yield ("tool_call_unwrapped", [
        user("Weather?"), assistant("", tool_calls=[call("get_weather", {"city": "Oslo"}, wrap=False)]), tool("snow")],
        [WEATHER_TOOL], {})
    yield ("multi_step_tools_then_user", [
        user("Plan my day"), assistant(None, tool_calls=[weather_call_str]), tool("sunny"),
        assistant("Go for a walk.", reasoning_content="It is sunny."), user("Thanks! And tomorrow?")],
        [WEATHER_TOOL], {})
    yield ("user_tool_response_text", [
        user("<tool_response>\nold\n</tool_response>"), assistant("ok"), user("next")], None, {})
    yield ("unicode_content", [
        system("Réponds en français 🇫🇷"), user("日本語で答えて: 👩🏽‍💻 est quoi ?"), assistant("C'est « un développeur ».")],
        None, {})
    yield ("special_characters", [
        user("Quotes \" and ' and backslash \\ and tab\tand {{ braces }} {% tags %}"), assistant("<b>html</b> & more")],
        None, {})
    yield ("empty_strings", [system(""), user(""), assistant("")], None, {})
    yield ("system_only", [system("You are a pirate.")], None, {})
    yield ("two_system_messages", [system("First rule."), system("Second rule."), user("Go")], None, {})
    yield ("system_in_middle", [user("a"), system("Switch to formal tone."), user("b")], None, {})
    yield ("long_conversation", sum(([user(f"Question {i}?"), assistant(f"Answer {i}.")] for i in range(8)), []) + [
        user("Last question?")], None, {})
    yield ("extra_message_fields", [
        {"role": "user", "content": "hi", "name": "bob", "id": 7}, assistant("hey", meta={"x": 1})], None, {})
    yield ("think_with_blank_lines", [
        user("q"), assistant("<think>\n\n\nlots of space\n\n</think>\n\n\nanswer"), user("q2")], None, {})
    yield ("empty_tools_list", [user("Hello")], [], {})
    yield ("tool_first_message", [tool("orphan result"), user("what was that?")], None, {})
    yield ("multiline_content", [user("line one\nline two\n\n  indented\n"), assistant("reply\n")], None, {
        "add_generation_prompt": False})
    yield ("thinking_disabled_multi_turn", [
        user("a"), assistant("<think>\nx\n</think>\n\nb"), user("c")], None, {"enable_thinking": False})
    yield ("tool_response_then_generation", [
        user("Search cats"), assistant(None, tool_calls=[call("search", json.dumps({"query": "cats", "top_k": 3}))]),
        tool("Cats are great.")], [SEARCH_TOOL], {"enable_thinking": False})
    yield ("tool_calls_empty_content", [
        user("Weather in Paris and search news"),
        assistant("", tool_calls=[weather_call_str, call("search", json.dumps({"query": "news"}))]),
        tool("sunny"), tool("no news"), assistant("Sunny, and no news.")], [WEATHER_TOOL, SEARCH_TOOL], {})
    yield ("tool_round_trip_thinking_off", [
        system("Use tools."), user("Search cats"),
        assistant("", tool_calls=[call("search", {"query": "cats", "top_k": 3, "safe": False, "tags": []})]),
        tool("Cats are great."), user("Summarise")], [SEARCH_TOOL], {"enable_thinking": False})
    yield ("nested_tool_arguments", [
        user("Book"), assistant("", tool_calls=[call("book", {"who": {"name": "Ana", "age": 30},
                                                              "when": ["mon", "tue"], "notes": "a\nb\t\"c\""})])],
        [WEATHER_TOOL], {"add_generation_prompt": False})


def render(tokenizer, messages, tools, options):
    kwargs = dict(options)
    kwargs.setdefault("add_generation_prompt", True)
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)


def main():
    assert transformers.__version__ == "5.17.0", transformers.__version__
    chat_tokenizers = {name: transformers.AutoTokenizer.from_pretrained(str(TOKENIZERS / name)) for name in NAMES}
    raw_tokenizers = {name: tokenizers.Tokenizer.from_file(str(TOKENIZERS / name / "tokenizer.json")) for name in NAMES}
    output = []
    for index, (name, messages, tools, options) in enumerate(cases()):
        case = {"name": name, "messages": messages, "tools": tools, "options": options, "expected": {}, "errors": {},
                "ids": {}}
        for tokenizer_name, tokenizer in chat_tokenizers.items():
            try:
                text = render(tokenizer, messages, tools, options)
                case["expected"][tokenizer_name] = text
                if index < IDS_FOR_FIRST_CASES:
                    ids = raw_tokenizers[tokenizer_name].encode(text, add_special_tokens=False).ids
                    case["ids"][tokenizer_name] = ids
            except Exception as error:  # transformers' own failure is the expected outcome for this case
                case["errors"][tokenizer_name] = f"{type(error).__name__}: {error}"
        output.append(case)
    (FIXTURES / "chat_cases.json").write_text(json.dumps(output, ensure_ascii=False, indent=1) + "\n")
    rendered = sum(len(case["expected"]) for case in output)
    print(f"{len(output)} conversations, {rendered} renderings, "
          f"{sum(len(case['errors']) for case in output)} expected errors")
    for name, tokenizer in chat_tokenizers.items():
        print(name, tokenizer.special_tokens_map)


if __name__ == "__main__":
    main()
