"""OpenAI-compatible chat servers for the regenerate tests.

- `transformers_serve`: the real `transformers serve` (from the `transformers[serving]` extra) on the
  bundled tiny target, in a subprocess on a free localhost port, one per test session.
- `ScriptedServer`: a threaded HTTP server whose answers the test writes (the reply to a user turn is
  "re: <that turn>"), that can fail its first requests, and that counts requests in flight.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dflash_cache.demo import ASSETS
from dflash_cache.train.distributed import free_port

TARGET = ASSETS / "target"


@pytest.fixture(scope="session")
def transformers_serve(tmp_path_factory) -> str:
    """The URL of `transformers serve` pinned to the bundled target, on the CPU."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "transformers.cli.transformers",
                "serve",
                str(TARGET),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--device",
                "cpu",
                # fp32: in bf16 a near-tie can flip between the server's batches and a lone `generate`
                # (seen on a CPU that emulates bf16 products)
                "--dtype",
                "float32",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"transformers serve exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"transformers serve did not answer within 120 s:\n{log.read_text()[-2000:]}")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ScriptedServer:
    def __init__(
        self,
        model: str = "scripted",
        fail_first: int = 0,
        fail_status: int = 503,
        delay_s: float = 0.0,
        models_status: int = 200,
    ):
        self.model, self.fail_first, self.fail_status = model, fail_first, fail_status
        self.delay_s, self.models_status = delay_s, models_status
        self.requests: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def _answer(self, body: dict) -> tuple[int, dict]:
        with self._lock:
            self.requests.append(body)
            number = len(self.requests)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            time.sleep(self.delay_s)
            if number <= self.fail_first:
                return self.fail_status, {"error": f"scripted failure {number}"}
            last = body["messages"][-1]["content"]
            message = {"role": "assistant", "content": f"re: {last}", "reasoning_content": f"thinking about {last}"}
            return 200, {
                "model": self.model,
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4},
            }
        finally:
            with self._lock:
                self.in_flight -= 1

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._send(server.models_status, {"object": "list", "data": [{"id": server.model}]})
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/v1/chat/completions":
                    self._send(404, {"error": "not found"})
                    return
                self._send(*server._answer(body))

        return Handler


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]
