"""OpenAI-compatible chat servers: `vllm serve`, SGLang, `transformers serve`, or any other.

Requests go to POST {url}/v1/chat/completions. A failed attempt (no connection, a timeout, HTTP 5xx,
429 or 408, an answer that is no usable completion: answers.py) is retried with exponential backoff,
each retry on the next server, so work flows around a server that went down; any other HTTP error (a
prompt too long for the context, say) is the request's own and is not retried. An answer is read
uncompressed, at most `AnswerLimits.max_bytes` of it, within `AnswerLimits.seconds` of sending the
request (checked as each piece arrives; a server that sends nothing is given up after that long). The reasoning of a server's reasoning parser comes back as
`reasoning_content` (vLLM's newer `reasoning` is read too).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from dflash_cache.errors import DFlashCacheError, first_line
from dflash_cache.regenerate.answers import AnswerLimits, BadAnswer, read_answer
from dflash_cache.regenerate.conversations import Completion
from dflash_cache.regenerate.settings import GenerationSettings
from dflash_cache.store.remote import redact

RETRIED_STATUS = {408, 429, 500, 502, 503, 504}
TIMEOUT = httpx.Timeout(connect=10.0, read=1800.0, write=60.0, pool=None)  # a long answer takes minutes


class RequestFailed(Exception):
    """A request that failed for good; the message names the servers and the causes."""


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 6
    first_delay_s: float = 1.0
    max_delay_s: float = 30.0

    def delay(self, attempt: int) -> float:
        """Before retry number `attempt` (1-based): doubling, capped, with jitter so retries spread out."""
        return min(self.max_delay_s, self.first_delay_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)


def api_base(url: str) -> str:
    """'http://host:8000', '.../v1' or '.../v1/' -> 'http://host:8000/v1'."""
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise DFlashCacheError(f"--server {url!r} is not an http:// or https:// URL")
    return url if url.endswith("/v1") else url + "/v1"


class ServerPool:
    def __init__(
        self,
        urls: list[str],
        concurrency: int,
        retry: RetryPolicy = RetryPolicy(),
        stopping: threading.Event | None = None,
        limits: AnswerLimits | None = None,
        on_tokens: Callable[[int], None] = lambda n: None,
    ):
        """`on_tokens(n)` with the tokens of each answer as it arrives (a server tells no sooner)."""
        if not urls:
            raise DFlashCacheError("give at least one --server")
        self.urls = [api_base(url) for url in urls]
        if len(set(self.urls)) != len(self.urls):
            raise DFlashCacheError("a --server URL is given twice")
        self.retry = retry
        self.limits = limits or AnswerLimits()
        self.stopping = stopping or threading.Event()
        self.on_tokens = on_tokens
        limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
        self._http = httpx.Client(timeout=TIMEOUT, limits=limits)
        self._models: dict[str, str | None] = {}

    def probe(self) -> None:
        """Every server must answer; the model a server lists (when it lists exactly one) is asked for by name."""
        for url in self.urls:
            try:
                response = self._http.get(f"{url}/models", timeout=10.0)
            except httpx.HTTPError as e:
                raise DFlashCacheError(
                    _hide(f"server {url} is not reachable ({_reason(e)}); start it or leave it out", url)
                ) from None
            model = None
            if response.status_code == 200:  # transformers serve answers 500 here when pinned to a local folder
                try:
                    listed = [entry["id"] for entry in response.json()["data"]]
                    model = listed[0] if len(listed) == 1 else None
                except (ValueError, KeyError, TypeError):
                    pass
            self._models[url] = model

    def complete(self, messages: list[dict], settings: GenerationSettings, lane: int) -> Completion:
        """One assistant turn; `lane` picks the first server to try, so lanes spread over the servers."""
        errors = []
        for attempt in range(self.retry.attempts):
            if attempt and self.stopping.wait(self.retry.delay(attempt)):
                break
            url = self.urls[(lane + attempt) % len(self.urls)]
            body: dict = {"messages": messages, "max_tokens": settings.max_tokens, "temperature": settings.temperature}
            if self._models.get(url):
                body["model"] = self._models[url]
            if settings.template_kwargs():
                body["chat_template_kwargs"] = settings.template_kwargs()
            try:
                status, text = self._post(f"{url}/chat/completions", body, settings.max_tokens)
                if status in RETRIED_STATUS:
                    errors.append(_hide(f"{url}: HTTP {status} {_detail(text)}", url))
                    continue
                if status != 200:
                    raise RequestFailed(_hide(f"{url} refused the request: HTTP {status} {_detail(text)}", url))
                completion = read_answer(text)
                self.on_tokens(completion.completion_tokens)
                return completion
            except httpx.HTTPError as e:
                errors.append(_hide(f"{url}: {_reason(e)}", url))
            except BadAnswer as e:
                errors.append(_hide(f"{url} {e}", url))
        tries = f"{len(errors)} attempt(s)" if errors else "stopping"
        raise RequestFailed(f"failed after {tries}: {'; '.join(dict.fromkeys(errors)) or 'the run is stopping'}")

    def _post(self, url: str, body: dict, max_tokens: int) -> tuple[int, bytes]:
        """(HTTP status, body) of one attempt; BadAnswer for a body too large or too slow to arrive."""
        limit, seconds = self.limits.max_bytes(max_tokens), self.limits.seconds(max_tokens)
        deadline = time.monotonic() + seconds
        timeout = httpx.Timeout(
            connect=TIMEOUT.connect, read=min(TIMEOUT.read, seconds), write=TIMEOUT.write, pool=None
        )
        with self._http.stream(
            "POST", url, json=body, timeout=timeout, headers={"Accept-Encoding": "identity"}
        ) as response:
            too_large = BadAnswer(
                f"answered with more than {limit:,} bytes, more than --max-tokens {max_tokens} can take"
            )
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limit:
                raise too_large
            pieces, size = [], 0
            for piece in response.iter_raw():
                size += len(piece)
                if size > limit:
                    raise too_large
                if time.monotonic() > deadline:
                    raise BadAnswer(
                        f"timed out: the answer took more than {seconds:,.0f} s "
                        f"(the limit for --max-tokens {max_tokens})"
                    )
                pieces.append(piece)
            return response.status_code, b"".join(pieces)

    def close(self) -> None:
        self._http.close()


def _hide(message: str, url: str) -> str:
    """`message` with the `user:password@` of `url` (httpx sends it as basic auth) shown as `***@`,
    wherever the URL appears in it (httpx's own errors quote the request URL)."""
    return message.replace(url, redact(url))


def _reason(error: httpx.HTTPError) -> str:
    kind = {httpx.ConnectError: "connection refused or host unknown", httpx.TimeoutException: "timed out"}
    for cls, text in kind.items():
        if isinstance(error, cls):
            return text
    return f"{type(error).__name__}: {first_line(error)}"


def _detail(body: bytes) -> str:
    text = " ".join(body.decode("utf-8", "replace").split())
    return f"({text[:200]})" if text else ""
