"""One conversation record to the messages a chat template reads.

Fields read from each message (`messages` form; ShareGPT turns use `from`/`value` for role/content
and the same optional fields):
- `role`: user, assistant, system, tool; also `developer` (read as system, as OpenAI defines it),
  `ipython` (Llama 3.x's name for a tool result: tool), and ShareGPT's human, gpt, chatgpt, function
  and observation (tool) and function_call (an assistant tool call whose value is `{"name",
  "arguments"}` as JSON).
- `content`: a string, or a list of parts `[{"type": "text", "text": ...}]` joined without a
  separator (as templates that read parts render them); any other part is an error. `null` or absent
  only on an assistant message that has reasoning (read as "") or tool calls (read as null, which
  DeepSeek's templates need; tokenize.py hands "" to templates that refuse null: gpt-oss, QwQ).
- `reasoning_content`, `reasoning` or `thinking` (assistant): the reasoning, handed to the template
  under both names templates read (`reasoning_content`: Qwen, DeepSeek; `thinking`: gpt-oss).
- `tool_calls` (assistant): OpenAI form `{"id", "type", "function": {"name", "arguments"}}` or flat
  `{"name", "arguments"}`; arguments an object or a JSON string of one. Normalised to the OpenAI form,
  arguments as ToolArguments: the object with its JSON text (the given text where there was one);
  tokenize.py hands each template the form it renders.
- `tool_call_id`, `name` (tool): passed on.
A record may also carry `tools` (a list of tool definitions, or a JSON string of one) and, ShareGPT
only, `system` (a system prompt put first).
"""

from __future__ import annotations

import json

from dflash_cache.errors import DFlashCacheError

ROLES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "function_call": "assistant",
    "system": "system",
    "developer": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "ipython": "tool",
}
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


class ToolArguments(dict):
    """A tool call's arguments: a mapping, whose text (`str()`) is its JSON."""

    def __init__(self, value: dict, text: str | None = None):
        super().__init__(value)
        self.text = text if text is not None else json.dumps(value, ensure_ascii=False)

    def __str__(self) -> str:
        return self.text

    def __reduce__(self):  # pickled to tokenizer processes with its text
        return ToolArguments, (dict(self), self.text)


def show(value: object, limit: int = 40) -> str:
    """A user value quoted on one line and cut short, for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_conversation(obj: dict, form: str, prompts: bool = False) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) of a record in the `messages` or ShareGPT `conversations` form; with
    `prompts`, one without an assistant turn too (a prompt for the target to answer)."""
    turns = obj[form]
    if not isinstance(turns, list) or not turns:
        raise DFlashCacheError(f"'{form}' must be a non-empty list of turns")
    role_key, content_key = ("role", "content") if form == "messages" else ("from", "value")
    messages = []
    system = obj.get("system") if form == "conversations" else None
    if system is not None:
        if not isinstance(system, str):
            raise DFlashCacheError(f"'system' must be a string, found {show(system)}")
        messages.append({"role": "system", "content": system})
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise DFlashCacheError(f"{form}[{i}] must be an object, found {type(turn).__name__}")
        messages.append(_message(turn, f"{form}[{i}]", role_key, content_key))
    if not prompts and not any(m["role"] == "assistant" for m in messages):
        raise DFlashCacheError("the conversation has no assistant turn, so nothing to train on")
    return messages, _tools(obj.get("tools"))


def parse_message(turn: object, name: str) -> dict:
    """One message of the `messages` form, normalised as in a conversation; errors name `name`."""
    if not isinstance(turn, dict):
        raise DFlashCacheError(f"{name} must be an object, found {type(turn).__name__}")
    return _message(turn, name, "role", "content")


def _message(turn: dict, name: str, role_key: str, content_key: str) -> dict:
    raw_role = turn.get(role_key)
    if not isinstance(raw_role, str) or raw_role not in ROLES:
        known = ", ".join(sorted(ROLES))
        raise DFlashCacheError(f"{name} has unknown role {show(raw_role)} (known: {known})")
    role = ROLES[raw_role]
    if raw_role == "function_call":  # ShareGPT (LLaMA-Factory): the value is the call itself
        call = _json_value(turn.get(content_key), f"{name}.{content_key}")
        return {"role": "assistant", "content": None, "tool_calls": [_tool_call(call, f"{name}.{content_key}")]}
    message: dict = {"role": role}
    reasoning = _reasoning(turn, name) if role == "assistant" else None
    tool_calls = turn.get("tool_calls") if role == "assistant" else None
    if tool_calls is not None:
        if not isinstance(tool_calls, list):
            raise DFlashCacheError(f"{name}.tool_calls must be a list, found {show(tool_calls)}")
        tool_calls = [_tool_call(call, f"{name}.tool_calls[{j}]") for j, call in enumerate(tool_calls)]
    content = turn.get(content_key)
    if content is None and tool_calls:
        message["content"] = None
    else:
        message["content"] = _content(
            "" if content is None and reasoning is not None else content, f"{name}.{content_key}"
        )
    if reasoning is not None:
        message["reasoning_content"] = message["thinking"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if key in turn:
                if not isinstance(turn[key], str):
                    raise DFlashCacheError(f"{name}.{key} must be a string, found {show(turn[key])}")
                message[key] = turn[key]
    return message


def _content(content: object, name: str) -> str:
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type", "text") != "text"
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise DFlashCacheError(f"{name}[{j}] is a {show(kind)} part; only text parts can be trained on")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise DFlashCacheError(f"{name} must be a string or a list of text parts, found {show(content)}")
    _check_unicode(content, name)
    return content


def _reasoning(turn: dict, name: str) -> str | None:
    values = {key: turn[key] for key in REASONING_KEYS if turn.get(key) is not None}
    for key, value in values.items():
        if not isinstance(value, str):
            raise DFlashCacheError(f"{name}.{key} must be a string, found {show(value)}")
        _check_unicode(value, f"{name}.{key}")
    if len(set(values.values())) > 1:
        raise DFlashCacheError(f"{name} has different reasoning in {' and '.join(values)}; keep one")
    return next(iter(values.values()), None)


def _tool_call(call: object, name: str) -> dict:
    if not isinstance(call, dict):
        raise DFlashCacheError(f"{name} must be an object, found {show(call)}")
    function = call.get("function", call)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise DFlashCacheError(f"{name} needs a function name ('function': {{'name': ...}} or 'name')")
    arguments, text = function.get("arguments", {}), None
    if isinstance(arguments, str):
        text = arguments
        arguments = _json_value(arguments, f"{name} arguments") if arguments.strip() else {}
    if not isinstance(arguments, dict):
        raise DFlashCacheError(f"{name} arguments must be an object or a JSON string of one, found {show(arguments)}")
    normal = {"type": "function", "function": {"name": function["name"], "arguments": ToolArguments(arguments, text)}}
    if isinstance(call.get("id"), str):
        normal["id"] = call["id"]
    return normal


def _tools(tools: object) -> list[dict] | None:
    if tools is None:
        return None
    if isinstance(tools, str):
        tools = _json_value(tools, "'tools'") if tools.strip() else []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DFlashCacheError(f"'tools' must be a list of tool definitions (objects), found {show(tools)}")
    return tools or None


def _json_value(text: object, name: str) -> object:
    if not isinstance(text, str):
        raise DFlashCacheError(f"{name} must be a JSON string, found {show(text)}")
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        raise DFlashCacheError(f"{name} is not valid JSON: {show(text)}") from None


def _check_unicode(text: str, name: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise DFlashCacheError(f"{name} is not valid Unicode") from None
