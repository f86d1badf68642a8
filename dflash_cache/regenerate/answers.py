"""A server's answer, read as strictly as `extract` will read the record it becomes.

An answer that `extract` would refuse (a tool call without a name or whose arguments are not JSON,
content that is not text, text that is not valid Unicode, a number that is not finite) or that no
counting can give (a token count that is negative or not a whole number) is a failed attempt: the
request is retried, then stops the run or is skipped, and is never written as a finished record.
The message fields are checked by the reader's own code (data/messages.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from dflash_cache.data.messages import parse_message, show
from dflash_cache.errors import DFlashCacheError
from dflash_cache.regenerate.conversations import Completion


class BadAnswer(Exception):
    """An answer that is no usable chat completion; the message says what is wrong with it."""


@dataclass(frozen=True)
class AnswerLimits:
    """How many bytes and seconds one answer may take, from the request's --max-tokens."""

    bytes_per_token: int = 1024  # a long token's text JSON-escaped, in the content and again in the reasoning
    base_bytes: int = 1 << 20  # the rest of a completion object
    seconds_per_token: float = 0.5  # at least 2 tokens a second for each request, under any load
    base_s: float = 600.0  # waiting for a slot, and the prefill of a long conversation

    def max_bytes(self, max_tokens: int) -> int:
        return self.base_bytes + self.bytes_per_token * max_tokens

    def seconds(self, max_tokens: int) -> float:
        return self.base_s + self.seconds_per_token * max_tokens


def read_answer(text: bytes) -> Completion:
    """The completion in a server's HTTP 200 body; BadAnswer naming what `extract` would refuse."""
    try:
        data = json.loads(text)
        choice = data["choices"][0]
        message = choice["message"]
        usage = data.get("usage") or {}
        tokens = usage.get("completion_tokens")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError):
        raise BadAnswer(f"answered with something that is not a chat completion: {text[:120]!r}") from None
    if not isinstance(message, dict):
        raise BadAnswer(f"answered with a message that is not an object: {show(message)}")
    if tokens is None:
        tokens = 0  # a server that does not count
    if type(tokens) is not int or tokens < 0:
        raise BadAnswer(f"answered with usage.completion_tokens {show(tokens)}, not a count of tokens")
    content = message.get("content")
    completion = Completion(
        content="" if content is None else content,
        reasoning_content=message.get("reasoning_content") or message.get("reasoning") or None,
        tool_calls=message.get("tool_calls") or None,
        finish_reason=str(choice.get("finish_reason")),
        completion_tokens=tokens,
        model=str(data.get("model")),
    )
    try:
        parse_message(completion.message(), "its message")
    except DFlashCacheError as e:
        raise BadAnswer(f"answered with a message extract would refuse: {e}") from None
    try:  # what is written: every string valid Unicode, every number finite
        json.dumps(asdict(completion), ensure_ascii=False, allow_nan=False).encode("utf-8")
    except UnicodeEncodeError:
        raise BadAnswer("answered with text that is not valid Unicode (a lone surrogate)") from None
    except ValueError:
        raise BadAnswer("answered with a number that is not finite (NaN or Infinity)") from None
    return completion
