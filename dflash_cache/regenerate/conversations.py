"""Which assistant turns a conversation regenerates, and the conversation rebuilt turn by turn.

Each regenerated assistant turn is asked for with the conversation before it: the user, system and
tool turns as they were, and (with --turns all) the earlier assistant turns as the target has just
written them. A prompt-only conversation (no assistant turn) gets one: the target's answer to the
whole conversation, appended. The reasoning of earlier turns is not sent back: serving clients do not, and chat
templates of reasoning models drop it from past turns anyway. The record keeps it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from dflash_cache.data.readers import Conversation, read_records
from dflash_cache.errors import DFlashCacheError

# Message fields that hold a turn's reasoning, in the forms `extract` reads.
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")


@dataclass(frozen=True)
class Completion:
    """One generated assistant turn, as a server (or the in-process target) returns it."""

    content: str
    reasoning_content: str | None
    tool_calls: list[dict] | None  # OpenAI form: [{"id", "type": "function", "function": {"name", "arguments"}}]
    finish_reason: str  # "stop", "length" (hit max_tokens), "tool_calls", or what the server says
    completion_tokens: int
    model: str

    def message(self) -> dict:
        message: dict = {"role": "assistant", "content": self.content}
        if self.reasoning_content:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


@dataclass(frozen=True)
class Job:
    source: str  # "file:line"
    messages: list[dict]
    record_id: str | None = None  # the record's own `id`, written with its answer


def read_jobs(paths: list[str | Path], limit: int | None = None) -> Iterator[Job]:
    """Every conversation of the data files (the first `limit` of them), in order; pre-tokenized
    records cannot be answered again."""
    records = (record for path in paths for record in read_records(path, prompts=True))
    for record in itertools.islice(records, limit):
        if not isinstance(record, Conversation):
            raise DFlashCacheError(
                f"{record.where}: a pre-tokenized record; regenerate needs conversations "
                "({'messages': [...]} or ShareGPT) to ask the target"
            )
        yield Job(record.where, record.messages, record.record_id)


def turns_to_regenerate(messages: list[dict], turns: str) -> list[int]:
    """Indices of the assistant turns to answer again; for a prompt-only conversation, [len(messages)]:
    a turn appended after it."""
    assistant = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    if not assistant:
        return [len(messages)]
    return assistant if turns == "all" else assistant[-1:]


def request_messages(messages: list[dict]) -> list[dict]:
    """The conversation as sent to the target: past turns without their reasoning, tool-call
    arguments as the JSON text the OpenAI API takes."""
    return [
        {
            key: _calls_as_text(value) if key == "tool_calls" else value
            for key, value in message.items()
            if key not in REASONING_FIELDS
        }
        if message["role"] == "assistant"
        else message
        for message in messages
    ]


def _calls_as_text(calls: list[dict]) -> list[dict]:
    return [
        {**call, "function": {**call["function"], "arguments": str(call["function"]["arguments"])}} for call in calls
    ]


def regenerate_conversation(
    messages: list[dict], turns: str, complete: Callable[[list[dict]], Completion]
) -> tuple[list[dict], list[Completion]]:
    """The conversation with its assistant turns answered again by `complete`, in order."""
    out = [dict(message) for message in messages]
    completions = []
    for index in turns_to_regenerate(messages, turns):
        completion = complete(request_messages(out[:index]))
        out[index : index + 1] = [completion.message()]
        completions.append(completion)
    return out, completions
