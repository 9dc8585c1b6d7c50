"""Starts `vavilov serve` on a test model for the server tests. VAVILOV_BINARY names the binary;
VAVILOV_TEST_THREADS its CPU threads (default 2); VAVILOV_TEST_DEVICE its --device (default: the server's own);
VAVILOV_TEST_MODEL_DIR a test model directory made beforehand by make_test_model.py (for machines without the
`tokenizers` package, such as the GPU machine)."""
import atexit
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "models_mtp", "mtp_f32_hc4")
MODEL_NAME = "test-model"

_model_dir = None


def model_dir():
    """The test model directory (fixture checkpoint + generated tokenizer), built once per process."""
    global _model_dir
    if _model_dir is None and os.environ.get("VAVILOV_TEST_MODEL_DIR"):
        _model_dir = os.environ["VAVILOV_TEST_MODEL_DIR"]
    if _model_dir is None:
        work = tempfile.mkdtemp(prefix="vavilov-server-test-")
        atexit.register(shutil.rmtree, work, True)
        _model_dir = os.path.join(work, "model")
        subprocess.run([sys.executable, os.path.join(HERE, "make_test_model.py"), FIXTURE, _model_dir], check=True)
    return _model_dir


def markup():
    with open(os.path.join(model_dir(), "markup.json")) as f:
        return json.load(f)


class Server:
    """One server process on a free loopback port; stopped with SIGTERM."""

    def __init__(self, *args, ready=True):
        binary = os.environ["VAVILOV_BINARY"]
        command = [binary, "serve", "--model", model_dir(), "--model-name", MODEL_NAME, "--port", "0",
                   "--threads", os.environ.get("VAVILOV_TEST_THREADS", "2"), *args]
        if os.environ.get("VAVILOV_TEST_DEVICE"):
            command += ["--device", os.environ["VAVILOV_TEST_DEVICE"]]
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
        self.log = []
        self.port = None
        self._ready = threading.Event()
        self._listening = threading.Event()
        threading.Thread(target=self._read_log, daemon=True).start()
        if not self._listening.wait(30) or self.port is None:
            self.stop()
            raise RuntimeError("server did not start:\n" + "".join(self.log))
        if ready and not self._ready.wait(60):
            self.stop()
            raise RuntimeError("model did not load:\n" + "".join(self.log))

    def _read_log(self):
        for line in self.process.stderr:
            self.log.append(line)
            found = re.search(r"listening on http://[^:]+:(\d+)", line)
            if found:
                self.port = int(found.group(1))
                self._listening.set()
            if "ready" in line:
                self._ready.set()
        self._listening.set()

    @property
    def base_url(self):
        return f"http://127.0.0.1:{self.port}"

    def request(self, method, path, body=None, headers=None, timeout=60):
        """(status, headers, body bytes); `body` may be bytes, str or a JSON-able object."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        if body is not None and not isinstance(body, (bytes, str)):
            body = json.dumps(body)
        all_headers = {"Content-Type": "application/json", **(headers or {})}
        connection.request(method, path, body=body, headers=all_headers)
        response = connection.getresponse()
        data = response.read()
        connection.close()
        return response.status, dict(response.getheaders()), data

    def metric(self, name):
        _, _, text = self.request("GET", "/metrics")
        total = 0.0
        for line in text.decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self, timeout=60):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise
        finally:
            if self.process.returncode is not None:
                self.process.stderr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def wait_for(predicate, timeout=10.0, interval=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
