"""Hostile OpenAI-compatible servers against `regenerate`: answers that `extract` would refuse, values
no counting gives, text that is not Unicode, an answer far larger than --max-tokens allows, one sent a
byte at a time; and SIGTERM before the first record. Each answer is a failed request (retried, then an
error or a listed skip), never a written record, and never a bare exception."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from click.testing import CliRunner

from dflash_cache.data.readers import read_records
from dflash_cache.errors import DFlashCacheError
from dflash_cache.regenerate.answers import AnswerLimits
from dflash_cache.regenerate.client import RetryPolicy
from dflash_cache.regenerate.run import RegenerateOptions, regenerate
from dflash_cache.regenerate.settings import GenerationSettings
from dflash_cache_cli.main import main
from tests.support.chatservers import write_jsonl

FAST = RetryPolicy(attempts=2, first_delay_s=0.01, max_delay_s=0.02)


class HostileServer:
    """Answers every chat request with the bytes `answer(request)` gives, with HTTP 200: all
    at once with a Content-Length, or (`byte_every_s`) one byte at a time until the connection closes;
    `hold` answers nothing until the server closes."""

    def __init__(self, answer, byte_every_s: float = 0.0, hold: bool = False):
        self.answer, self.byte_every_s, self.hold = answer, byte_every_s, hold
        self.requests = 0
        self.closed = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self._send(json.dumps({"object": "list", "data": [{"id": "hostile"}]}).encode(), 0.0)

            def do_POST(self) -> None:
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests += 1
                if server.hold:
                    server.closed.wait()
                    return
                self._send(server.answer(request), server.byte_every_s)

            def _send(self, data: bytes, byte_every_s: float) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                if not byte_every_s:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    if not byte_every_s:
                        self.wfile.write(data)
                    for i in range(len(data) if byte_every_s else 0):
                        self.wfile.write(data[i : i + 1])
                        self.wfile.flush()
                        if server.closed.wait(byte_every_s):
                            return
                except (BrokenPipeError, ConnectionResetError):  # the client gave up on the answer
                    pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def close(self) -> None:
        self.closed.set()
        self._httpd.shutdown()
        self._httpd.server_close()


@pytest.fixture
def hostile():
    started: list[HostileServer] = []

    def start(answer, **kwargs) -> HostileServer:
        started.append(HostileServer(answer if callable(answer) else lambda request: answer, **kwargs))
        return started[-1]

    yield start
    for server in started:
        server.close()


def completion_bytes(message: dict, tokens: object = 3) -> bytes:
    """A chat completion as a server sends it (Python's json writes NaN and Infinity as such)."""
    return json.dumps(
        {
            "model": "hostile",
            "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": "stop"}],
            "usage": {"completion_tokens": tokens},
        }
    ).encode()


def call(function: dict) -> dict:
    return {"content": None, "tool_calls": [{"id": "c1", "type": "function", "function": function}]}


GOOD = completion_bytes({"content": "fine"})
HOSTILE = {
    # each was written as a finished record (exit 0); extract then stopped at its line
    "arguments_not_json": (
        completion_bytes(call({"name": "f", "arguments": "{not json"})),
        "arguments is not valid JSON",
    ),
    "call_without_name": (completion_bytes(call({"arguments": "{}"})), "needs a function name"),
    "content_a_number": (completion_bytes({"content": 5}), "content must be a string or a list of text parts, found 5"),
    "content_an_object": (completion_bytes({"content": {"a": 1}}), "content must be a string or a list of text parts"),
    "negative_tokens": (completion_bytes({"content": "x"}, -3), "usage.completion_tokens -3, not a count of tokens"),
    # these ended the whole run with a bare OverflowError / UnicodeEncodeError, even with --on-error skip
    "infinite_tokens": (completion_bytes({"content": "x"}, float("inf")), "usage.completion_tokens inf, not a count"),
    "lone_surrogate": (completion_bytes({"content": "a\ud800b"}), "content is not valid Unicode"),
    "lone_surrogate_in_model": (GOOD.replace(b'"hostile"', b'"\\udc80"'), "text that is not valid Unicode"),
    # accepted whole: a 300 MB answer to --max-tokens 16 took 1.3 GB and became a 300 MB record
    "far_too_large": (completion_bytes({"content": "x" * (3 << 20)}), "answered with more than 1,064,960 bytes"),
}


def conversations(tmp_path, n: int = 2):
    return write_jsonl(
        tmp_path / "data.jsonl",
        [
            {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "old"}]}
            for i in range(n)
        ],
    )


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_an_answer_extract_would_refuse_is_a_failed_request_never_a_record(tmp_path, hostile, case):
    answer, reason = HOSTILE[case]
    server = hostile(answer)
    data, out = conversations(tmp_path), tmp_path / "out.jsonl"
    summary = regenerate(
        RegenerateOptions(
            data=[data],
            out=out,
            servers=[server.url],
            concurrency=1,
            retry=FAST,
            on_error="skip",
            settings=GenerationSettings(max_tokens=16),
        )
    )
    assert summary.records == 0 and [source for source, _ in summary.skipped] == [f"{data}:1", f"{data}:2"]
    assert all(reason in why and f"failed after {FAST.attempts} attempt(s)" in why for _, why in summary.skipped), (
        summary.skipped
    )
    assert server.requests == 2 * FAST.attempts and not out.exists()  # each retried; nothing written
    with pytest.raises(DFlashCacheError, match=f"{data}:1: failed after {FAST.attempts} attempt"):
        regenerate(
            RegenerateOptions(
                data=[data],
                out=out,
                servers=[server.url],
                concurrency=1,
                retry=FAST,
                settings=GenerationSettings(max_tokens=16),
            )
        )


def test_the_cli_skips_and_lists_them_and_writes_only_what_extract_reads(tmp_path, hostile, monkeypatch):
    """Through the command line, with --on-error skip: one record always answered with Infinity tokens
    (skipped and listed), one answered with a lone surrogate once (retried, then written), the rest
    good; exit 0, and every written line is read back by extract's own reader."""
    monkeypatch.setattr(RetryPolicy, "delay", lambda self, attempt: 0.0)  # the CLI's policy, without its waits
    seen: list[str] = []

    def answer(request: dict) -> bytes:
        question = request["messages"][-1]["content"]
        seen.append(question)
        if question == "q1":
            return HOSTILE["infinite_tokens"][0]
        return HOSTILE["lone_surrogate"][0] if question == "q2" and seen.count("q2") == 1 else GOOD

    server = hostile(answer)
    data, out = conversations(tmp_path, 4), tmp_path / "out.jsonl"
    result = CliRunner().invoke(
        main,
        [
            "regenerate",
            "--data",
            str(data),
            "--out",
            str(out),
            "--server",
            server.url,
            "--concurrency",
            "1",
            "--max-tokens",
            "16",
            "--on-error",
            "skip",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "done: 3 records written" in result.stdout and "failures: 1 record(s) skipped" in result.stdout, (
        result.output
    )
    assert (
        f"  {data}:2: failed after 6 attempt(s): {server.url}/v1 answered with usage.completion_tokens inf"
        in result.stdout
    )
    assert seen.count("q1") == 6 and seen.count("q2") == 2
    assert [record.where for record in read_records(out)] == [f"{out}:1", f"{out}:2", f"{out}:3"]
    assert sorted(json.loads(line)["source"] for line in out.read_text().splitlines()) == [
        f"{data}:{i}" for i in (1, 3, 4)
    ]


def test_an_answer_sent_a_byte_at_a_time_is_timed_out_as_a_whole(tmp_path, hostile):
    """The read timeout counted each byte afresh: a server sending one byte a second was never given up."""
    server = hostile(GOOD, byte_every_s=0.2)  # the whole answer would take over 20 s
    data, out = conversations(tmp_path, 1), tmp_path / "out.jsonl"
    started = time.monotonic()
    with pytest.raises(
        DFlashCacheError, match=r"timed out: the answer took more than 1 s \(the limit for --max-tokens 16\)"
    ):
        regenerate(
            RegenerateOptions(
                data=[data],
                out=out,
                servers=[server.url],
                concurrency=1,
                retry=FAST,
                settings=GenerationSettings(max_tokens=16),
                limits=AnswerLimits(base_s=1.0, seconds_per_token=0.0),
            )
        )
    assert time.monotonic() - started < 8 and server.requests == FAST.attempts and not out.exists()


@pytest.mark.slow
def test_sigterm_before_the_first_record_leaves_no_output_file(tmp_path, hostile):
    """SIGTERM (what Slurm and Kubernetes send) ended the process at once and left a 0-byte --out."""
    server = hostile(GOOD, hold=True)
    data, out = conversations(tmp_path, 1), tmp_path / "out.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dflash_cache_cli.main",
            "regenerate",
            "--data",
            str(data),
            "--out",
            str(out),
            "--server",
            server.url,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    deadline = time.monotonic() + 60
    while not server.requests:  # the output file is open and locked before the first request
        assert proc.poll() is None and time.monotonic() < deadline, (
            proc.stderr.read() if proc.poll() is not None else ""
        )
        time.sleep(0.05)
    assert out.exists()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143 and err.endswith("\nerror: terminated\n"), (proc.returncode, err)
    assert not out.exists()
