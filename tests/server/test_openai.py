"""The server through the official `openai` client: chat and completions, streaming and not, stop strings,
tool calls, reasoning, usage, sampling parameters."""
import json
import unittest

import openai

import harness

NO_EOS = {"0": -100, "1": -100}  # <|endoftext|> and <|im_end|> both end a reply

server = None
client = None


def setUpModule():
    global server, client
    server = harness.Server("--parallel", "4")
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def tearDownModule():
    server.stop()


MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello to the world."}]


def chat(**kwargs):
    return client.chat.completions.create(model=harness.MODEL_NAME, **{"messages": MESSAGES, "temperature": 0,
                                                                          **kwargs})


def stream_chat(**kwargs):
    """(content, reasoning, tool calls by index, finish reasons, ids, usage chunks) of a streamed chat."""
    content, reasoning, calls, reasons, ids, usage = "", "", {}, [], set(), []
    for chunk in chat(stream=True, **kwargs):
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage.append(chunk.usage)
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": "", "id": None})
                entry["id"] = entry["id"] or call.id
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            reasons.append(choice.finish_reason)
    return content, reasoning, calls, reasons, ids, usage


def bias(key, value=100):
    return {str(harness.markup()["ids"][key]): value}


class Chat(unittest.TestCase):
    def test_non_streaming_shape_and_usage(self):
        response = chat(max_tokens=12)
        self.assertTrue(response.id.startswith("chatcmpl-"))
        self.assertEqual(response.object, "chat.completion")
        self.assertEqual(response.model, harness.MODEL_NAME)
        choice = response.choices[0]
        self.assertEqual(choice.message.role, "assistant")
        self.assertIsInstance(choice.message.content, str)
        self.assertIn(choice.finish_reason, ("stop", "length"))
        usage = response.usage
        self.assertGreater(usage.prompt_tokens, 10)
        self.assertLessEqual(usage.completion_tokens, 12)
        self.assertEqual(usage.total_tokens, usage.prompt_tokens + usage.completion_tokens)
        self.assertIsNotNone(usage.prompt_tokens_details.cached_tokens)

    def test_streaming_matches_non_streaming(self):
        whole = chat(max_tokens=24)
        content, _, _, reasons, ids, usage = stream_chat(max_tokens=24, stream_options={"include_usage": True})
        self.assertEqual(content, whole.choices[0].message.content)
        self.assertEqual(len(ids), 1)
        self.assertEqual([r for r in reasons if r is not None], [whole.choices[0].finish_reason])
        self.assertIsNotNone(reasons[-1])  # finish_reason only on the last choice chunk
        self.assertEqual(len(usage), 1)
        self.assertEqual(usage[0].completion_tokens, whole.usage.completion_tokens)
        self.assertEqual(usage[0].prompt_tokens, whole.usage.prompt_tokens)

    def test_max_tokens_and_max_completion_tokens(self):
        for key in ("max_tokens", "max_completion_tokens"):
            response = chat(**{key: 5}, logit_bias=bias("repeat"))
            self.assertEqual(response.usage.completion_tokens, 5)
            self.assertEqual(response.choices[0].finish_reason, "length")
            self.assertEqual(response.choices[0].message.content, "Zq!" * 5)

    def test_stop_strings_never_leak(self):
        # The stop string "!Z" only ever appears across two tokens ("Zq!" "Zq!").
        response = chat(max_tokens=6, logit_bias=bias("repeat"), stop=["!Z"])
        self.assertEqual(response.choices[0].message.content, "Zq")
        self.assertEqual(response.choices[0].finish_reason, "stop")
        content, _, _, reasons, _, _ = stream_chat(max_tokens=6, logit_bias=bias("repeat"), stop="!Z")
        self.assertEqual(content, "Zq")
        self.assertEqual(reasons[-1], "stop")
        # A stop prefix that never completes is held back, then released.
        content, *_ = stream_chat(max_tokens=3, logit_bias=bias("repeat"), stop=["!Zx"])
        self.assertEqual(content, "Zq!" * 3)

    def test_stop_string_in_model_text(self):
        text = chat(max_tokens=32, logit_bias=NO_EOS).choices[0].message.content
        self.assertGreater(len(text), 6)
        stop = text[3:6]
        expected = text[: text.find(stop)]
        response = chat(max_tokens=32, logit_bias=NO_EOS, stop=[stop, "\u2603never"])
        self.assertEqual(response.choices[0].message.content, expected)
        self.assertEqual(response.choices[0].finish_reason, "stop")
        self.assertEqual(stream_chat(max_tokens=32, logit_bias=NO_EOS, stop=stop)[0], expected)

    def test_tool_calls_json_form(self):
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
        response = chat(max_tokens=1, tools=tools, logit_bias=bias("tool_json"))
        choice = response.choices[0]
        self.assertEqual(choice.finish_reason, "tool_calls")
        self.assertIsNone(choice.message.content)
        [call] = choice.message.tool_calls
        self.assertEqual(call.type, "function")
        self.assertTrue(call.id.startswith("call_"))
        self.assertEqual(call.function.name, "get_weather")
        self.assertEqual(json.loads(call.function.arguments), {"city": "Paris", "days": 3})
        content, _, calls, reasons, _, _ = stream_chat(max_tokens=1, tools=tools, logit_bias=bias("tool_json"))
        self.assertEqual(content, "")
        self.assertEqual(list(calls), [0])
        self.assertEqual(calls[0]["name"], "get_weather")
        self.assertEqual(json.loads(calls[0]["arguments"]), {"city": "Paris", "days": 3})
        self.assertEqual(reasons[-1], "tool_calls")

    def test_tool_calls_xml_form_and_history(self):
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
        response = chat(max_tokens=2, tools=tools, logit_bias=bias("tool_xml"))
        calls = response.choices[0].message.tool_calls
        self.assertEqual(len(calls), 2)
        self.assertEqual(json.loads(calls[1].function.arguments), {"city": "Berlin", "days": 2})
        # The assistant's tool calls and the tool's answer go back in as history.
        history = MESSAGES + [response.choices[0].message.model_dump(exclude_none=True),
                              {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"}]
        follow_up = client.chat.completions.create(model=harness.MODEL_NAME, messages=history, tools=tools,
                                                   temperature=0, max_tokens=4)
        self.assertGreater(follow_up.usage.prompt_tokens, response.usage.prompt_tokens)
        # Without tools offered (or with tool_choice none) the markup stays text.
        plain = chat(max_tokens=1, logit_bias=bias("tool_xml"))
        self.assertIn("<function=get_weather>", plain.choices[0].message.content)

    def test_reasoning_content(self):
        response = chat(max_tokens=1, logit_bias=bias("think"))
        message = response.choices[0].message
        self.assertEqual(message.reasoning_content, "The user wants a greeting.")
        self.assertEqual(message.content, "Hello there!")
        _, reasoning, _, _, _, _ = stream_chat(max_tokens=1, logit_bias=bias("think"))
        self.assertEqual(reasoning, "The user wants a greeting.")
        off = chat(max_tokens=1, logit_bias=bias("think"), extra_body={"chat_template_kwargs": {
            "enable_thinking": False}})
        self.assertIn("<think>", off.choices[0].message.content)

    def test_sampling_parameters(self):
        seeded = dict(temperature=1.0, top_p=0.9, max_tokens=16, logit_bias=NO_EOS)
        a = chat(seed=7, **seeded).choices[0].message.content
        b = chat(seed=7, **seeded).choices[0].message.content
        self.assertEqual(a, b)
        others = {chat(seed=s, **seeded).choices[0].message.content for s in range(8, 12)}
        self.assertGreater(len(others | {a}), 1)
        greedy = chat(max_tokens=16).choices[0].message.content
        top1 = chat(max_tokens=16, temperature=1.5, extra_body={"top_k": 1}, seed=1).choices[0].message.content
        self.assertEqual(top1, greedy)
        penalised = chat(max_tokens=16, frequency_penalty=2, presence_penalty=1.5,
                         extra_body={"min_p": 0.05, "repetition_penalty": 1.3})
        self.assertIsInstance(penalised.choices[0].message.content, str)

    def test_unicode_round_trip(self):
        response = chat(max_tokens=2, logit_bias=bias("emoji"),
                        messages=[{"role": "user", "content": "caf\u00e9 \u2615 ok"}])
        self.assertEqual(response.choices[0].message.content, "caf\u00e9 \u2615 ok" * 2)

    def test_errors_through_the_client(self):
        with self.assertRaises(openai.NotFoundError):
            client.chat.completions.create(model="gpt-nope", messages=MESSAGES)
        with self.assertRaises(openai.BadRequestError) as caught:
            chat(n=2)
        self.assertEqual(caught.exception.body["param"], "n")
        with self.assertRaises(openai.BadRequestError) as caught:
            chat(max_tokens=100000)
        self.assertEqual(caught.exception.body["code"], "context_length_exceeded")


class Completions(unittest.TestCase):
    def test_non_streaming_and_streaming_agree(self):
        response = client.completions.create(model=harness.MODEL_NAME, prompt="The quick brown fox", max_tokens=20,
                                             temperature=0)
        self.assertEqual(response.object, "text_completion")
        self.assertTrue(response.id.startswith("cmpl-"))
        text = response.choices[0].text
        streamed, reasons, ids, usage = "", [], set(), None
        for chunk in client.completions.create(model=harness.MODEL_NAME, prompt="The quick brown fox", max_tokens=20,
                                               temperature=0, stream=True, stream_options={"include_usage": True}):
            ids.add(chunk.id)
            usage = chunk.usage or usage
            for choice in chunk.choices:
                streamed += choice.text
                reasons.append(choice.finish_reason)
        self.assertEqual(streamed, text)
        self.assertEqual(len(ids), 1)
        self.assertEqual(reasons[-1], response.choices[0].finish_reason)
        self.assertTrue(all(r is None for r in reasons[:-1]))
        self.assertEqual(usage.completion_tokens, response.usage.completion_tokens)

    def test_token_id_prompt_and_stop(self):
        response = client.completions.create(model=harness.MODEL_NAME, prompt=[5, 17, 42, 7], max_tokens=4,
                                             temperature=0, logit_bias=bias("repeat"), stop=["q!Z"])
        self.assertEqual(response.choices[0].text, "Z")
        self.assertEqual(response.usage.prompt_tokens, 4)


if __name__ == "__main__":
    unittest.main()
