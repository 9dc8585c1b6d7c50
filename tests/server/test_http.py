"""Raw HTTP: malformed requests, auth, limits, queueing, cancellation and graceful shutdown."""
import http.client
import json
import socket
import threading
import time
import unittest

import harness

NO_EOS = {"0": -100, "1": -100}  # <|endoftext|> and <|im_end|> both end a reply

CHAT = "/v1/chat/completions"


def body(**kwargs):
    return {"model": harness.MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "temperature": 0, **kwargs}


def endless(**kwargs):
    """A request that keeps generating (EOS suppressed) until cancelled."""
    return body(max_tokens=100000, logit_bias=NO_EOS, **kwargs)


class Errors(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = harness.Server("--max-body-kb", "64", "--ctx", "512")

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def expect_error(self, status, payload, path=CHAT, param=None, code=None, method="POST"):
        got, headers, data = self.server.request(method, path, payload)
        self.assertEqual(got, status, data)
        self.assertTrue(headers["Content-Type"].startswith("application/json"))
        error = json.loads(data)["error"]
        self.assertIsInstance(error["message"], str)
        self.assertTrue(error["message"])
        self.assertIn("type", error)
        if param is not None:
            self.assertEqual(error["param"], param)
        if code is not None:
            self.assertEqual(error["code"], code)
        return error

    def test_malformed_bodies(self):
        self.expect_error(400, b"{not json")
        self.expect_error(400, b"")
        self.expect_error(400, b"[1, 2]")
        self.expect_error(400, b'{"model": "test-model", "messages": [{"role": "user", "content": "\xff\xfe"}]}')
        self.expect_error(400, {"model": harness.MODEL_NAME})  # no messages
        self.expect_error(400, {"model": harness.MODEL_NAME, "prompt": 5}, path="/v1/completions", param="prompt")

    def test_wrong_types_and_ranges(self):
        self.expect_error(400, body(temperature="warm"), param="temperature")
        self.expect_error(400, body(max_tokens=-1), param="max_tokens")
        self.expect_error(400, body(top_p=0), param="top_p")
        self.expect_error(400, body(stream="yes"), param="stream")
        self.expect_error(400, body(stop=[1, 2]), param="stop")
        self.expect_error(400, body(logit_bias={"x": 1}), param="logit_bias")
        self.expect_error(400, body(messages=[{"role": "user", "content": 3}]), param="messages[0].content")

    def test_unsupported_parameters(self):
        self.expect_error(400, body(n=3), param="n")
        self.expect_error(400, body(logprobs=True), param="logprobs")
        self.expect_error(400, body(response_format={"type": "json_object"}), param="response_format")
        self.expect_error(400, body(tools=[], tool_choice="required"), param="tool_choice")

    def test_unknown_model_and_endpoint(self):
        self.expect_error(404, body(model="gpt-4o"), param="model", code="model_not_found")
        self.expect_error(404, body(), path="/v1/embeddings")
        self.expect_error(404, None, path="/v2/whatever", method="GET")

    def test_context_overflow(self):
        self.expect_error(400, body(max_tokens=600), code="context_length_exceeded")
        long = " ".join(["word"] * 2000)
        self.expect_error(400, body(messages=[{"role": "user", "content": long}]), code="context_length_exceeded")

    def test_body_size_limit(self):
        huge = body(messages=[{"role": "user", "content": "x" * (100 * 1024)}])
        self.expect_error(413, huge)

    def test_health_models_metrics(self):
        status, _, data = self.server.request("GET", "/health")
        self.assertEqual((status, json.loads(data)["status"]), (200, "ok"))
        status, _, data = self.server.request("GET", "/v1/models")
        self.assertEqual(json.loads(data)["data"][0]["id"], harness.MODEL_NAME)
        self.server.request("POST", CHAT, body(max_tokens=3))
        for name in ("vavilov_requests_total", "vavilov_prompt_tokens_total", "vavilov_generation_tokens_total",
                     "vavilov_generation_tokens_per_second", "vavilov_queue_depth", "vavilov_prefix_cache_hits_total",
                     "vavilov_spec_drafts_proposed_total", "vavilov_spec_drafts_accepted_total"):
            self.assertGreaterEqual(self.server.metric(name), 0, name)
        self.assertGreater(self.server.metric("vavilov_generation_tokens_total"), 0)
        self.assertGreater(self.server.metric("vavilov_spec_drafts_proposed_total"), 0)


class Auth(unittest.TestCase):
    def test_api_key(self):
        with harness.Server("--api-key", "sekrit") as server:
            self.assertEqual(server.request("GET", "/health")[0], 200)
            for path, method, payload in (("/v1/models", "GET", None), (CHAT, "POST", body(max_tokens=2)),
                                          ("/metrics", "GET", None)):
                status, headers, data = server.request(method, path, payload)
                self.assertEqual(status, 401, path)
                self.assertEqual(json.loads(data)["error"]["code"], "invalid_api_key")
                wrong = server.request(method, path, payload, headers={"Authorization": "Bearer nope"})[0]
                self.assertEqual(wrong, 401)
                good = server.request(method, path, payload, headers={"Authorization": "Bearer sekrit"})[0]
                self.assertEqual(good, 200, path)


def open_stream(server, payload):
    """A raw streaming request; returns the socket after the response headers arrived."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    data = json.dumps(payload).encode()
    sock.sendall(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    received = b""
    while b"\r\n\r\n" not in received:
        received += sock.recv(4096)
    return sock


class Scheduling(unittest.TestCase):
    def test_queue_full_and_cancellation(self):
        with harness.Server("--parallel", "1", "--queue", "1", "--ctx", "200000") as server:
            running = open_stream(server, endless(stream=True))
            self.assertTrue(harness.wait_for(lambda: server.metric("vavilov_active_sequences") == 1))
            waiting = open_stream(server, endless(stream=True))
            self.assertTrue(harness.wait_for(lambda: server.metric("vavilov_queue_depth") == 1))
            status, _, data = server.request("POST", CHAT, body(max_tokens=2))
            self.assertEqual(status, 429)
            self.assertEqual(json.loads(data)["error"]["type"], "rate_limit_error")
            # A client that goes away stops its generation; the waiting one then runs.
            generated = server.metric("vavilov_generation_tokens_total")
            running.close()
            self.assertTrue(harness.wait_for(lambda: server.metric("vavilov_queue_depth") == 0))
            waiting.close()
            self.assertTrue(harness.wait_for(lambda: server.metric("vavilov_active_sequences") == 0))
            settled = server.metric("vavilov_generation_tokens_total")
            time.sleep(0.5)
            self.assertEqual(server.metric("vavilov_generation_tokens_total"), settled)
            self.assertGreater(settled, generated)
            self.assertEqual(server.request("POST", CHAT, body(max_tokens=2))[0], 200)

    def test_non_streaming_client_that_leaves_is_cancelled(self):
        with harness.Server("--ctx", "200000") as server:
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            data = json.dumps(endless()).encode()
            sock.sendall(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
            self.assertTrue(harness.wait_for(lambda: server.metric("vavilov_active_sequences") == 1))
            sock.close()
            self.assertTrue(harness.wait_for(lambda: server.metric("vavilov_active_sequences") == 0))
            settled = server.metric("vavilov_generation_tokens_total")
            time.sleep(0.5)
            self.assertEqual(server.metric("vavilov_generation_tokens_total"), settled)
            self.assertEqual(server.request("POST", CHAT, body(max_tokens=2))[0], 200)

    def test_long_prompt_prefills_between_other_sequences_steps(self):
        # A prompt of ~190 chunks: while it prefills, the streaming sequence keeps getting a step per chunk.
        with harness.Server("--parallel", "2", "--prefill-chunk", "16", "--ctx", "200000",
                            "--cache-mb", "0") as server:
            stream = open_stream(server, endless(stream=True))
            events = []

            def count():
                stream.settimeout(30)
                while True:
                    chunk = stream.recv(65536)
                    if not chunk:
                        return
                    events.append((time.monotonic(), chunk.count(b"data: ")))

            reader = threading.Thread(target=count, daemon=True)
            reader.start()
            self.assertTrue(harness.wait_for(lambda: sum(n for _, n in events) > 5))
            long_prompt = body(max_tokens=1, messages=[{"role": "user", "content": "word " * 3000}])
            sent = time.monotonic()
            status, _, data = server.request("POST", CHAT, long_prompt, timeout=120)
            answered = time.monotonic()
            self.assertEqual(status, 200, data)
            self.assertGreater(json.loads(data)["usage"]["prompt_tokens"], 2000)
            during = sum(n for t, n in events if sent < t < answered)
            self.assertGreater(during, 100)
            stream.close()

    def test_time_limit(self):
        with harness.Server("--timeout", "1", "--ctx", "200000") as server:
            status, _, data = server.request("POST", CHAT, endless())
            self.assertEqual(status, 504)
            self.assertIn("time limit", json.loads(data)["error"]["message"])

    def test_graceful_shutdown_finishes_in_flight_requests(self):
        # Long enough (seconds on the test model) that the poll below sees it running; well inside the grace.
        tokens = 5000
        results = []
        with harness.Server("--shutdown-grace", "60", "--ctx", "200000") as server:
            def run():
                results.append(server.request("POST", CHAT, body(max_tokens=tokens, logit_bias=NO_EOS)))

            thread = threading.Thread(target=run)
            thread.start()
            self.assertTrue(harness.wait_for(lambda: server.metric("vavilov_active_sequences") == 1))
            self.assertEqual(server.stop(), 0)
            thread.join()
        status, _, data = results[0]
        self.assertEqual(status, 200)
        self.assertEqual(json.loads(data)["usage"]["completion_tokens"], tokens)

    def test_shutdown_cancels_past_the_grace_period(self):
        server = harness.Server("--shutdown-grace", "0", "--ctx", "200000")
        sock = open_stream(server, endless(stream=True))
        self.assertTrue(harness.wait_for(lambda: server.metric("vavilov_active_sequences") == 1))
        started = time.monotonic()
        self.assertEqual(server.stop(), 0)
        self.assertLess(time.monotonic() - started, 10)
        sock.settimeout(10)
        tail = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            tail += chunk
        self.assertIn(b"shut down", tail)
        self.assertIn(b"data: [DONE]", tail)


if __name__ == "__main__":
    unittest.main()
