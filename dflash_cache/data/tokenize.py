"""Conversations to token ids and a loss mask of what the model generates, through the chat template.

The mask rule: for each assistant message, every token the model generates in that turn, as the
full conversation is rendered: from the end of the generation prompt (the text the template adds
for `add_generation_prompt=True`, e.g. `<|im_start|>assistant\\n`, or `...assistant\\n<think>\\n`
where the template opens the think block itself) through the turn's end-of-turn token (`<|im_end|>`,
`<|eot_id|>`, `</s>`, `<|return|>`...). That covers reasoning, content, tool calls and the markup
between them; separators after the end-of-turn token and the next turn's header are not masked.

The spans are found by rendering, never by searching the data for marker strings, with a bounded
number of renders whatever the number of turns:
1. the conversation is rendered as given ("full"), and once more with every non-empty field of every
   message (content, reasoning, tool-call names) replaced by a unique stand-in ("probe"; a content
   opening with a <think> block gets one for the block and one for the rest, as templates that split
   it off do, and a second probe without that split where it does not fit). The probe
   splits into the template's own text and the stand-ins; walking the full rendering along those
   pieces gives where each field's text lies in it (the field as given, or trimmed: templates `trim`).
   A stand-in missing from the probe is a field the template does not render (Qwen3 drops the
   reasoning of earlier turns, DeepSeek-R1-Distill of every turn): reported as dropped, which makes
   the record a bad one (dataset.py), never a sample that quietly differs from the data.
2. a turn starts after the last copy of the generation prompt that starts before its first field;
   where there is none, after the longest part of the prompt that ends a line or a special token
   (past turns rendered without the think block the prompt opens); with no generation prompt at all
   (Mistral), after the user turn's closing text; failing all, at its first field.
3. a turn ends after the first end-of-turn token in the template text after its last field. The
   generation prompt and the end-of-turn tokens are read once per template from renderings of a
   one-word conversation (the last special token closing a final turn, the first one closing a past
   turn), and are cached.
4. the prompts of the first and last assistant turns are rendered to check they are prefixes of the
   full rendering; where one is not, the training text differs from what the model sees when it
   generates that turn (Mistral v3 moves the system prompt into the last user turn): reported.
Tool-call arguments reach each template in the form it renders as JSON: a mapping to templates that
serialise it (`tojson`, `|items`), the JSON text to templates that concatenate it as a string
(DeepSeek); found once per template by rendering a call both ways (_arguments_as_text).
Character spans become token spans by the tokenizer's offsets: a token is masked when any of its
characters is in a span (a leading space merged into the first content token is generated too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import jinja2
import numpy as np

from dflash_cache.data.messages import ToolArguments
from dflash_cache.errors import DFlashCacheError

# Mask kinds, per masked token (inspect reports counts of each): the text of reasoning and content
# fields; a turn's tool calls from the end of the text before the first to the end-of-turn token;
# markup for the rest (think tags, channel headers, the end-of-turn token).
KINDS = ("content", "reasoning", "tool_call", "markup")
_MARK = "\ue000{}\ue001"  # private-use characters: no template trims or escapes them


@dataclass
class Encoded:
    input_ids: list[int]
    loss_mask: list[int]
    kinds: np.ndarray  # [T] uint8: 0 unmasked, 1 + index into KINDS
    unfaithful: list[str] = field(default_factory=list)  # how the rendering's turns differ from generation's
    dropped: list[str] = field(default_factory=list)  # the fields of the data the rendering leaves out


@dataclass(frozen=True)
class _Field:
    message: int
    kind: str  # content, reasoning, tool_call (a call's name), or "other" for non-assistant content
    values: tuple[str, ...]  # what the template may render for it, as given first
    mark: str
    inline: bool = False  # reasoning written in the content as a leading <think>...</think> block


@dataclass(frozen=True)
class _Template:
    turn_openers: tuple[str, ...]  # what ends right before generation starts, best first
    end_of_turn: tuple[str, ...]


_templates: dict[tuple, _Template] = {}
_argument_forms: dict[tuple, bool] = {}  # template key -> whether it takes arguments as JSON text


def tokenize_conversation(
    tokenizer, messages: list[dict], tools: list[dict] | None = None, template_kwargs: dict | None = None
) -> tuple[list[int], list[int]]:
    """Token ids of the chat-template rendering of `messages`, and a 0/1 mask of the generated tokens."""
    encoded = encode_conversation(tokenizer, messages, tools, template_kwargs)
    return encoded.input_ids, encoded.loss_mask


def encode_conversation(
    tokenizer, messages: list[dict], tools: list[dict] | None = None, template_kwargs: dict | None = None
) -> Encoded:
    """Ids, mask, the kind of each masked token and what the template does not render as given, of
    `messages` (data/messages.py's form) with `tools` and the template options `template_kwargs`."""
    if not getattr(tokenizer, "chat_template", None):
        raise DFlashCacheError(
            "the tokenizer has no chat template, so conversations cannot be tokenized; "
            "use a tokenizer with a chat template or give pre-tokenized input_ids"
        )
    kwargs = dict(template_kwargs or {})
    render = lambda msgs, prompt=False: _render(tokenizer, msgs, tools, kwargs, prompt)  # noqa: E731
    try:
        full = render(messages)
    except DFlashCacheError:
        if not any(m.get("content", "") is None for m in messages):
            raise
        # A null content beside tool calls, to a template that cannot take null (gpt-oss, QwQ): "".
        messages = [{**m, "content": ""} if m.get("content", "") is None else m for m in messages]
        full = render(messages)
    unfaithful: list[str] = []
    dropped: list[str] = []
    fields, probe_messages = _probe(messages, split_inline=True)
    try:
        spans = _align(full, render(probe_messages), fields, dropped)
    except DFlashCacheError:
        if not any(f.inline for f in fields):
            raise
        # A template that branches on the reasoning field (gpt-oss) renders inline reasoning as text.
        dropped.clear()
        fields, probe_messages = _probe(messages, split_inline=False)
        spans = _align(full, render(probe_messages), fields, dropped)
    template = _template(tokenizer, kwargs)
    turns = []
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for i in assistant:
        mine = [(s, e, f) for s, e, f in spans if f.message == i]
        if not mine:  # every field left out (SmolLM3 renders a tool-call turn as its markup alone)
            before = max((e for s, e, f in spans if f.message < i), default=0)
            after = min((s for s, e, f in spans if f.message > i), default=len(full))
            start = _turn_opening(full, before, after, template.turn_openers)
            eot, end = (None, None) if start is None else _turn_end(full, start, after, template.end_of_turn)
            if start is None or eot == end:
                dropped.append(f"assistant turn {i} is not rendered")
            else:
                turns.append((start, eot, end, []))
            continue
        before = max((e for s, e, f in spans if f.message != i and e <= mine[0][0]), default=0)
        after = min((s for s, e, f in spans if f.message != i and s >= mine[-1][1]), default=len(full))
        start = _turn_start(full, before, mine[0][0], template.turn_openers)
        eot, end = _turn_end(full, mine[-1][1], after, template.end_of_turn)
        if eot == end:  # the mask then ends with the turn's last field
            unfaithful.append(f"assistant turn {i} has no end-of-turn token")
        turns.append((start, eot, end, mine))
    for i in sorted({assistant[0], assistant[-1]} if assistant else ()):
        if i > 0 and not full.startswith(render(messages[:i], True)):
            unfaithful.append(f"the prompt of assistant turn {i} is not a prefix of the conversation")
    ids, kinds = _tokens(tokenizer, full, turns)
    return Encoded(ids, (kinds > 0).astype(np.int64).tolist(), kinds, unfaithful, dropped)


def check_token_ids(input_ids: np.ndarray, vocab_size: int) -> None:
    """Pre-tokenized ids must index the vocabulary."""
    bad = (input_ids < 0) | (input_ids >= vocab_size)
    if bad.any():
        position = int(bad.argmax())
        raise DFlashCacheError(
            f"token id {int(input_ids[position])} at position {position} is outside the tokenizer's "
            f"vocabulary of {vocab_size} ids"
        )


def _render(tokenizer, messages: list[dict], tools, kwargs: dict, add_generation_prompt: bool = False) -> str:
    as_text = _arguments_as_text(tokenizer, kwargs)
    return _apply(tokenizer, _with_arguments(messages, as_text), tools, kwargs, add_generation_prompt)


def _arguments_as_text(tokenizer, kwargs: dict) -> bool:
    """Whether this template takes tool-call arguments as JSON text rather than a mapping: the mapping
    fails to render (`+` with a string) or comes out as Python's repr instead of JSON."""
    key = (tokenizer.chat_template, json.dumps(kwargs, sort_keys=True, default=str))
    if key not in _argument_forms:
        _argument_forms[key] = _detect_arguments_as_text(tokenizer, kwargs)
    return _argument_forms[key]


def _detect_arguments_as_text(tokenizer, kwargs: dict) -> bool:
    arguments = {"key": "value"}
    user = {"role": "user", "content": "q"}
    for content in (None, ""):  # null beside tool calls (DeepSeek), or "" where a template refuses null (gpt-oss)
        for as_text in (False, True):
            call = {
                "role": "assistant",
                "content": content,
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "f", "arguments": json.dumps(arguments) if as_text else arguments},
                    }
                ],
            }
            try:
                rendered = _apply(tokenizer, [user, call], None, kwargs)
            except DFlashCacheError:
                continue
            if as_text or repr(arguments) not in rendered:
                return as_text
    return False  # no form renders: the template has no tool calls, and the mapping is left as it is


def _with_arguments(messages: list[dict], as_text: bool) -> list[dict]:
    """`messages` with each tool call's arguments as JSON text or a plain mapping."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {
                **m,
                "tool_calls": [
                    {
                        **call,
                        "function": {
                            **call["function"],
                            "arguments": _arguments(call["function"].get("arguments", {}), as_text),
                        },
                    }
                    for call in m["tool_calls"]
                ],
            }
        out.append(m)
    return out


def _arguments(value: object, as_text: bool) -> object:
    if isinstance(value, ToolArguments):
        return value.text if as_text else dict(value)
    return value


def _apply(tokenizer, messages: list[dict], tools, kwargs: dict, add_generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
        message = " ".join(str(e).split()) or type(e).__name__
        raise DFlashCacheError(f"the chat template failed on this conversation: {message}") from None


def _probe(messages: list[dict], split_inline: bool) -> tuple[list[_Field], list[dict]]:
    """Every field to locate, and the messages with each replaced by its stand-in; with `split_inline`,
    a leading <think> block of a content is a reasoning field of its own."""
    fields: list[_Field] = []
    probe = []

    def mark(i: int, kind: str, *values: str, inline: bool = False) -> str:
        fields.append(_Field(i, kind, values, _MARK.format(len(fields)), inline))
        return fields[-1].mark

    for i, m in enumerate(messages):
        m = dict(m)
        is_assistant = m["role"] == "assistant"
        inline = split_inline and is_assistant and _inline_reasoning(m)
        if inline:  # templates that read it (Qwen3, QwQ, DeepSeek) split it off; others render it as text
            reasoning, answer = inline
            m["reasoning_content"] = m["thinking"] = mark(i, "reasoning", reasoning, inline=True)
            m["content"] = mark(i, "content", m["content"], answer, answer.lstrip("\n"))
        elif m.get("reasoning_content"):
            m["reasoning_content"] = m["thinking"] = mark(i, "reasoning", m["reasoning_content"])
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**call, "function": {**call["function"], "name": mark(i, "tool_call", call["function"]["name"])}}
                for call in m["tool_calls"]
            ]
        # An empty content is left as it is (templates branch on it), unless it is all the turn has.
        if not inline and (
            m.get("content") or (is_assistant and not m.get("reasoning_content") and not m.get("tool_calls"))
        ):
            m["content"] = mark(i, "content" if is_assistant else "other", m.get("content") or "")
        probe.append(m)
    return fields, probe


def _inline_reasoning(message: dict) -> tuple[str, str] | None:
    """(reasoning, answer) of a content that opens with a <think> block, where no reasoning field is
    given; split as Qwen3's template does."""
    content = message.get("content")
    if message.get("reasoning_content") or not isinstance(content, str) or not content.lstrip().startswith("<think>"):
        return None
    if "</think>" not in content:
        return None
    head, answer = content.split("</think>", 1)
    return head.split("<think>", 1)[1].strip("\n"), answer


def _align(full: str, probe: str, fields: list[_Field], dropped: list[str]) -> list[tuple[int, int, _Field]]:
    """(start, end, field) in `full` of every field the template renders, in text order; those of the
    data it does not render go to `dropped`."""
    placed = []  # (position in the probe, field, first copy of it)
    for f in fields:
        at = probe.find(f.mark)
        if at < 0:
            if f.kind in ("reasoning", "tool_call", "content") and not f.inline:
                dropped.append(
                    f"the template does not render the {f.kind.replace('_', ' ')} of assistant turn {f.message}"
                )
            continue
        first = True
        while at >= 0:  # a field may be rendered again later (gpt-oss names the tool in its result)
            placed.append((at, f, first))
            at, first = probe.find(f.mark, at + 1), False
    placed.sort(key=lambda p: p[0])
    pieces, last = [], 0
    for at, f, _ in placed:
        pieces.append(probe[last:at])
        last = at + len(f.mark)
    tail = probe[last:]
    spans, pos = [], 0
    for k, (_, f, first) in enumerate(placed):
        if not full.startswith(pieces[k], pos):
            raise _misaligned()
        pos += len(pieces[k])
        after = pieces[k + 1] if k + 1 < len(placed) else tail
        length = _rendered_length(full, pos, f.values, after, k + 1 == len(placed))
        if first:
            spans.append((pos, pos + length, f))
        pos += length
    if full[pos:] != tail:
        raise _misaligned()
    for f in fields:  # an inline think block the template neither splits off nor keeps in the content
        if (
            f.inline
            and f.mark not in probe
            and not any(g.message == f.message and f.values[0] in full[s:e] for s, e, g in spans)
        ):
            dropped.append(f"the template does not render the reasoning of assistant turn {f.message}")
    return spans


def _rendered_length(full: str, pos: int, values: tuple[str, ...], after: str, last: bool) -> int:
    """How much of `full` from `pos` is the field: a value as given or trimmed, followed by `after`."""
    candidates = sorted(
        {
            c
            for v in values
            for c in (v, v.strip(), v.lstrip(), v.rstrip(), v.strip("\n"), v.lstrip("\n"), v.rstrip("\n"))
        },
        key=len,
        reverse=True,
    )
    for c in candidates:
        end = pos + len(c)
        if full.startswith(c, pos) and full.startswith(after, end) and (not last or end + len(after) == len(full)):
            return len(c)
    if after:  # rendered through a filter (tojson of a tool result...): up to the template text after it
        at = full.rfind(after) if last else full.find(after, pos)
        if at >= pos:
            return at - pos
    raise _misaligned()


def _misaligned() -> DFlashCacheError:
    return DFlashCacheError(
        "the chat template renders this conversation in a way whose turns cannot be located "
        "(it rewrites message text beyond trimming it)"
    )


def _template(tokenizer, kwargs: dict) -> _Template:
    """The generation prompt and end-of-turn tokens of this template, from one-word conversations."""
    render = lambda msgs, prompt=False: _render(tokenizer, msgs, None, kwargs, prompt)  # noqa: E731
    specials = _special_tokens(tokenizer)
    key = (tokenizer.chat_template, json.dumps(kwargs, sort_keys=True, default=str), tuple(specials))
    if key in _templates:
        return _templates[key]
    question, answer, call_name, follow_up = (_MARK.format(n) for n in range(4))
    user = {"role": "user", "content": question}
    reply = {"role": "assistant", "content": answer}
    prompt_only, with_prompt = render([user]), render([user], True)
    prompt = with_prompt[len(prompt_only) :] if with_prompt.startswith(prompt_only) else ""
    # The generation prompt; where a past turn was rendered without all of it (a think block it no
    # longer opens), its longest part that ends a line or a special token; a template with no
    # generation prompt (Mistral) starts generating right after the user turn's closing text.
    cuts = [
        prompt[:k]
        for k in range(len(prompt) - 1, 0, -1)
        if prompt[k - 1] == "\n" or any(prompt[:k].endswith(s) for s in specials)
    ]
    openers = [prompt, *cuts] if prompt else [_after(with_prompt, question)]
    final = render([user, reply])
    ends = set(_specials_in(_after(final, answer), specials)[-1:])  # what closes a final turn
    past = render([user, reply, {"role": "user", "content": follow_up}])
    ends.update(_specials_in(_after(past, answer).split(follow_up)[0], specials)[:1])  # ... and a past one
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": call_name, "arguments": ToolArguments({})}}],
    }
    try:
        called = render([user, call])
    except DFlashCacheError:
        called = ""  # a template without tool calls
    if call_name in called:
        ends.update(_specials_in(_after(called, call_name), specials)[-1:])
    _templates[key] = _Template(tuple(o for o in openers if o), tuple(sorted(ends, key=len, reverse=True)))
    return _templates[key]


def _after(text: str, mark: str) -> str:
    return text[text.index(mark) + len(mark) :] if mark in text else ""


def _special_tokens(tokenizer) -> list[str]:
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    names = {t.content for t in added.values() if getattr(t, "special", False)}
    names.update(getattr(tokenizer, "all_special_tokens", []) or [])
    return sorted((n for n in names if n), key=len, reverse=True)


def _specials_in(text: str, specials: list[str]) -> list[str]:
    """The special tokens in `text`, in order (longest match first at each position)."""
    found, pos = [], 0
    while pos < len(text):
        hit = next((s for s in specials if text.startswith(s, pos)), None)
        if hit:
            found.append(hit)
            pos += len(hit)
        else:
            pos += 1
    return found


def _turn_start(full: str, before: int, first: int, openers: tuple[str, ...]) -> int:
    for opener in openers:  # it may run into the first field: a content that opens with the prompt's <think>
        at = full.rfind(opener, before, first + len(opener))
        if at >= 0:
            return at + len(opener)
    return first


def _turn_opening(full: str, before: int, after: int, openers: tuple[str, ...]) -> int | None:
    """Where a turn with no rendered field starts: after the first generation prompt between the
    fields around it."""
    for opener in openers:
        at = full.find(opener, before, after)
        if at >= 0:
            return at + len(opener)
    return None


def _turn_end(full: str, last: int, after: int, ends: tuple[str, ...]) -> tuple[int, int]:
    """(start, end) of the end-of-turn token after the turn's last field; (last, last) if there is none."""
    hits = [(at, len(e)) for e in ends if (at := full.find(e, last, after)) >= 0]
    if not hits:
        return last, last
    at, length = min(hits)
    return at, at + length


def _tokens(tokenizer, full: str, turns: list[tuple[int, int, int, list]]) -> tuple[list[int], np.ndarray]:
    """Token ids of `full` and each token's mask kind; `turns` holds (start, end-of-turn start, end, fields)."""
    try:
        encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:
        raise DFlashCacheError("the tokenizer cannot report token offsets; a fast tokenizer is needed") from None
    offsets = np.array(encoded["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    starts, ends = offsets[:, 0], offsets[:, 1]
    kinds = np.zeros(len(starts), dtype=np.uint8)
    markup = 1 + KINDS.index("markup")
    tool_call = 1 + KINDS.index("tool_call")
    for start, eot, end, fields in turns:
        turn = (ends > start) & (starts < end)
        kinds[turn] = markup
        calls = [s for s, _, f in fields if f.kind == "tool_call"]
        if calls:  # a call's markup and arguments run from the end of the text before it to the end-of-turn token
            calls_from = max([start] + [e for _, e, f in fields if f.kind != "tool_call" and e <= calls[0]])
            kinds[turn & (ends > calls_from) & (starts < eot)] = tool_call
        for s, e, f in fields:
            if f.kind != "tool_call":
                kinds[turn & (ends > s) & (starts < e)] = 1 + KINDS.index(f.kind)
    return list(encoded["input_ids"]), kinds
