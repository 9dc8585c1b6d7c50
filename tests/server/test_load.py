"""Many simultaneous streams give the same greedy text as each request alone; a repeated long prompt is served
from the prefix cache with identical output."""
import concurrent.futures
import json
import time
import unittest

import openai

import harness

CLIENTS = 16


def prompt(i):
    return [{"role": "user", "content": f"Request number {i}: tell me about the quick brown fox, please."}]


def stream_text(client, messages, max_tokens):
    content, reasons, ids = "", [], set()
    for chunk in client.chat.completions.create(model=harness.MODEL_NAME, messages=messages, temperature=0,
                                                max_tokens=max_tokens, stream=True):
        ids.add(chunk.id)
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasons.append(choice.finish_reason)
    return content, reasons, ids


class Concurrency(unittest.TestCase):
    def test_simultaneous_streams_equal_single_runs(self):
        with harness.Server("--parallel", "8", "--queue", "16") as server:
            client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=300)
            lengths = [8 + 5 * (i % 7) for i in range(CLIENTS)]  # different lengths: sequences join and leave
            alone = [stream_text(client, prompt(i), lengths[i]) for i in range(CLIENTS)]
            with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
                together = list(pool.map(lambda i: stream_text(client, prompt(i), lengths[i]), range(CLIENTS)))
            for i in range(CLIENTS):
                content, reasons, ids = together[i]
                self.assertEqual(content, alone[i][0], f"client {i}")
                self.assertEqual(len(ids), 1)
                self.assertIn(reasons[-1], ("stop", "length"))
                self.assertEqual(reasons[-1], alone[i][1][-1])
            self.assertGreater(server.metric("vavilov_requests_total"), 2 * CLIENTS - 1)


class PrefixCache(unittest.TestCase):
    def test_repeated_long_prompt_is_cached(self):
        system = "You are a careful assistant. " * 40  # a few hundred tokens: several 64-token chunks
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "Summarise."}]
        with harness.Server("--prefill-chunk", "64") as server:
            client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)

            def ask(user):
                started = time.monotonic()
                response = client.chat.completions.create(
                    model=harness.MODEL_NAME, temperature=0, max_tokens=16,
                    messages=[messages[0], {"role": "user", "content": user}])
                return response, time.monotonic() - started

            first, _ = ask("Summarise.")
            second, _ = ask("Summarise.")
            self.assertEqual(first.usage.prompt_tokens_details.cached_tokens, 0)
            cached = second.usage.prompt_tokens_details.cached_tokens
            self.assertGreater(cached, 0)
            self.assertEqual(cached % 64, 0)
            self.assertGreaterEqual(cached, first.usage.prompt_tokens - 64)
            self.assertEqual(second.choices[0].message.content, first.choices[0].message.content)
            # Another question after the same system prompt reuses its chunks too.
            other, _ = ask("Something else entirely.")
            self.assertGreater(other.usage.prompt_tokens_details.cached_tokens, 0)
            self.assertEqual(server.metric("vavilov_prefix_cache_hits_total"), 2)
            self.assertEqual(server.metric("vavilov_prompt_tokens_cached_total"),
                             cached + other.usage.prompt_tokens_details.cached_tokens)
        # Same output from a server without the cache: restored state is exact.
        with harness.Server("--prefill-chunk", "64", "--cache-mb", "0") as server:
            client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
            fresh = client.chat.completions.create(model=harness.MODEL_NAME, temperature=0, max_tokens=16,
                                                   messages=messages)
            self.assertEqual(fresh.usage.prompt_tokens_details.cached_tokens, 0)
            self.assertEqual(fresh.choices[0].message.content, first.choices[0].message.content)


if __name__ == "__main__":
    unittest.main()
