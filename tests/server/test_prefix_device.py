"""The prefix cache on the server's device (VAVILOV_TEST_DEVICE: cpu in CI, cuda on the GPU machine), through the
standard library alone: a repeated long prompt starts from cached chunk-boundary states and gives the text of a
server without the cache; a chat that extends an earlier one reuses its chunks. Greedy, with the server's default
drafts (speculative decoding over restored states)."""
import json
import unittest

import harness

CHUNK = 16
SYSTEM = "You are a careful assistant. " * 12  # well over a few 16-token chunks


def chat(server, messages, max_tokens=16):
    status, _, body = server.request("POST", "/v1/chat/completions", {
        "model": harness.MODEL_NAME, "messages": messages, "temperature": 0, "max_tokens": max_tokens}, timeout=120)
    if status != 200:
        raise AssertionError(f"status {status}: {body[:500]!r}")
    response = json.loads(body)
    return response["choices"][0]["message"]["content"], response["usage"]


class PrefixCacheOnDevice(unittest.TestCase):
    def test_cached_states_continue_exactly(self):
        first_turn = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Summarise."}]
        with harness.Server("--prefill-chunk", str(CHUNK), "--cache-mb", "0") as server:
            want, _ = chat(server, first_turn)
            reply_text, _ = chat(server, first_turn, max_tokens=8)
            second_turn = first_turn + [{"role": "assistant", "content": reply_text},
                                        {"role": "user", "content": "And again, shorter."}]
            want_second, _ = chat(server, second_turn)
        with harness.Server("--prefill-chunk", str(CHUNK)) as server:
            got, usage = chat(server, first_turn)
            self.assertEqual(usage["prompt_tokens_details"]["cached_tokens"], 0)
            self.assertEqual(got, want)
            again, usage = chat(server, first_turn)
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            self.assertGreaterEqual(cached, usage["prompt_tokens"] - CHUNK)
            self.assertEqual(cached % CHUNK, 0)
            self.assertEqual(again, want)
            got_second, usage = chat(server, second_turn)
            self.assertGreater(usage["prompt_tokens_details"]["cached_tokens"], 0)
            self.assertEqual(got_second, want_second)
            self.assertEqual(server.metric("vavilov_prefix_cache_hits_total"), 2)
            self.assertGreater(server.metric("vavilov_prefix_cache_entries"), 0)


if __name__ == "__main__":
    unittest.main()
