"""Real chat templates (tests/fixtures/templates, sources in SOURCES.md) on the cases real data has.

The expected mask of every case is written out below as the text of each run of masked tokens: what
the model generates in each assistant turn (after the generation prompt, through the end-of-turn
token), read off the template by hand.
"""

import pytest
from jinja2.exceptions import UndefinedError

from dflash_cache.data.messages import parse_conversation
from dflash_cache.data.tokenize import KINDS, encode_conversation
from dflash_cache.errors import DFlashCacheError
from tests.support.templates import FAMILIES, family_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def tool_conversation() -> dict:
    call = {
        "role": "assistant",
        "content": None,  # OpenAI's form
        "tool_calls": [
            {
                "id": "call00001",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
            }
        ],
    }
    return {
        "messages": [
            {"role": "user", "content": "weather?"},
            call,
            {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": "sunny"},
            {"role": "assistant", "content": "Sunny."},
        ],
        "tools": TOOLS,
    }


CASES = {
    "single": {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]},
    "system_multi": {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1"},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "A2"},
        ]
    },
    "reasoning_content": {
        "messages": [
            {"role": "user", "content": "Q"},
            {"role": "assistant", "reasoning_content": "R.", "content": "A."},
        ]
    },
    "thinking": {
        "messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "thinking": "R.", "content": "A."}]
    },
    "tools": tool_conversation(),
    "empty": {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": ""}]},
    "parts": {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Q"}, {"type": "text", "text": "2"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "2"}]},
        ]
    },
    "trailing_user": {
        "messages": [
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1"},
            {"role": "user", "content": "Q2"},
        ]
    },
    # reasoning written into the content, as much data has it
    "inline_think": {
        "messages": [
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "<think>\nR1.\n</think>\n\nA1"},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "<think>\nR2.\n</think>\n\nA2"},
        ]
    },
}
INLINE = ["<think>\nR1.\n</think>\n\nA1", "<think>\nR2.\n</think>\n\nA2"]
INLINE_MASKED = ["<think>\nR1.\n</think>\n\nA1<|im_end|>", "<think>\nR2.\n</think>\n\nA2<|im_end|>"]

REFUSED = ["the template's own refusal"]
REFUSALS = {
    ("gemma2", "system_multi"): "System role not supported",
    ("gemma2", "tools"): "Conversation roles must alternate",
}
QWEN_CLOSE = "\n</think>\n\n"  # the generation prompt opens the think block; the model closes it
GPT_FINAL = "<|channel|>final<|message|>"
EOS_DS = "<｜end▁of▁sentence｜>"
# Templates that concatenate a tool call's arguments as a string (`+ tool['function']['arguments'] +`)
TEXT_ARGUMENTS = {"deepseek-r1-distill", "deepseek-v3.1", "deepseek-r1-distill-llama"}
EXPECTED = {
    "qwen3": {
        "single": [QWEN_CLOSE + "Hello there.<|im_end|>"],
        "system_multi": ["A1<|im_end|>", QWEN_CLOSE + "A2<|im_end|>"],
        "reasoning_content": ["R." + QWEN_CLOSE + "A.<|im_end|>"],
        "thinking": ["R." + QWEN_CLOSE + "A.<|im_end|>"],
        "tools": [
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
            QWEN_CLOSE + "Sunny.<|im_end|>",
        ],
        "empty": [QWEN_CLOSE + "<|im_end|>"],
        "parts": [QWEN_CLOSE + "A2<|im_end|>"],
        "trailing_user": ["A1<|im_end|>"],
        "inline_think": ["A1<|im_end|>", "R2." + QWEN_CLOSE + "A2<|im_end|>"],  # split off; dropped from the past turn
    },
    "gpt-oss": {
        "single": [GPT_FINAL + "Hello there.<|return|>"],
        "system_multi": [GPT_FINAL + "A1<|end|>", GPT_FINAL + "A2<|return|>"],
        "reasoning_content": ["<|channel|>analysis<|message|>R.<|end|><|start|>assistant" + GPT_FINAL + "A.<|return|>"],
        "thinking": ["<|channel|>analysis<|message|>R.<|end|><|start|>assistant" + GPT_FINAL + "A.<|return|>"],
        "tools": [
            ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
            GPT_FINAL + "Sunny.<|return|>",
        ],
        "empty": [GPT_FINAL + "<|return|>"],
        "parts": [GPT_FINAL + "A2<|return|>"],
        "trailing_user": [GPT_FINAL + "A1<|end|>"],
        "inline_think": [GPT_FINAL + INLINE[0] + "<|end|>", GPT_FINAL + INLINE[1] + "<|return|>"],  # kept as text
    },
    "llama3.1": {
        "single": ["Hello there.<|eot_id|>"],
        "system_multi": ["A1<|eot_id|>", "A2<|eot_id|>"],
        "reasoning_content": ["A.<|eot_id|>"],
        "thinking": ["A.<|eot_id|>"],
        "tools": ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', "Sunny.<|eot_id|>"],
        "empty": ["<|eot_id|>"],
        "parts": ["A2<|eot_id|>"],
        "trailing_user": ["A1<|eot_id|>"],
        "inline_think": [INLINE[0] + "<|eot_id|>", INLINE[1] + "<|eot_id|>"],
    },
    "deepseek-r1-distill": {
        "single": ["Hello there." + EOS_DS],
        "system_multi": ["A1" + EOS_DS, "A2" + EOS_DS],
        "reasoning_content": ["A." + EOS_DS],
        "thinking": ["A." + EOS_DS],
        # the arguments as the data wrote them: this template concatenates them as text
        "tools": [
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
            '{"city":"Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>' + EOS_DS,
            "Sunny." + EOS_DS,
        ],
        "empty": [EOS_DS],
        "parts": ["A2" + EOS_DS],
        "trailing_user": ["A1" + EOS_DS],
        "inline_think": ["\n\nA1" + EOS_DS, "\n\nA2" + EOS_DS],  # the template keeps what follows </think>
    },
    "deepseek-v3.1": {
        "single": ["Hello there." + EOS_DS],
        "system_multi": ["A1" + EOS_DS, "A2" + EOS_DS],
        "reasoning_content": ["A." + EOS_DS],
        "thinking": ["A." + EOS_DS],
        "tools": [
            '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city":"Paris"}<｜tool▁call▁end｜>'
            "<｜tool▁calls▁end｜>" + EOS_DS,
            "Sunny." + EOS_DS,
        ],
        "empty": [EOS_DS],
        "parts": ["A2" + EOS_DS],
        "trailing_user": ["A1" + EOS_DS],
        "inline_think": ["\n\nA1" + EOS_DS, "\n\nA2" + EOS_DS],
    },
    "qwen3.5": {  # the generation prompt opens the think block; turns after the last user query have one
        "single": [QWEN_CLOSE + "Hello there.<|im_end|>"],
        "system_multi": ["A1<|im_end|>", QWEN_CLOSE + "A2<|im_end|>"],
        "reasoning_content": ["R." + QWEN_CLOSE + "A.<|im_end|>"],
        "thinking": ["R." + QWEN_CLOSE + "A.<|im_end|>"],
        "tools": [
            QWEN_CLOSE + "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
            "</tool_call><|im_end|>",
            QWEN_CLOSE + "Sunny.<|im_end|>",
        ],
        "empty": [QWEN_CLOSE + "<|im_end|>"],
        "parts": [QWEN_CLOSE + "A2<|im_end|>"],
        "trailing_user": ["A1<|im_end|>"],
        "inline_think": [
            "R1." + QWEN_CLOSE + "A1<|im_end|>",
            "R2." + QWEN_CLOSE + "A2<|im_end|>",
        ],  # kept on past turns too
    },
    "qwq": {  # the generation prompt opens <think>, which the model does not generate and past turns lack
        "single": ["Hello there.<|im_end|>"],
        "system_multi": ["A1<|im_end|>", "A2<|im_end|>"],
        "reasoning_content": ["A.<|im_end|>"],
        "thinking": ["A.<|im_end|>"],
        "tools": [
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
            "Sunny.<|im_end|>",
        ],
        "empty": ["<|im_end|>"],
        "parts": ["A2<|im_end|>"],
        "trailing_user": ["A1<|im_end|>"],
        "inline_think": ["A1<|im_end|>", "R2." + QWEN_CLOSE + "A2<|im_end|>"],
    },
    "smollm3": {  # no reasoning field, no tool calls: a tool-call turn is its markup alone, whose end is generated
        "single": ["Hello there.<|im_end|>"],
        "system_multi": ["A1<|im_end|>", "A2<|im_end|>"],
        "reasoning_content": ["A.<|im_end|>"],
        "thinking": ["A.<|im_end|>"],
        "tools": ["<|im_end|>", "Sunny.<|im_end|>"],
        "empty": ["<|im_end|>"],
        "parts": ["A2<|im_end|>"],
        "trailing_user": ["A1<|im_end|>"],
        "inline_think": INLINE_MASKED,
    },
    "qwen2.5": {
        "single": ["Hello there.<|im_end|>"],
        "system_multi": ["A1<|im_end|>", "A2<|im_end|>"],
        "reasoning_content": ["A.<|im_end|>"],
        "thinking": ["A.<|im_end|>"],
        "tools": [
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
            "Sunny.<|im_end|>",
        ],
        "empty": ["<|im_end|>"],
        "parts": ["A2<|im_end|>"],
        "trailing_user": ["A1<|im_end|>"],
        "inline_think": [INLINE[0] + "<|im_end|>", INLINE[1] + "<|im_end|>"],
    },
    "qwen3-hybrid": {  # the last turn gets a think block (empty without reasoning) the model generates
        "single": ["<think>\n\n</think>\n\nHello there.<|im_end|>"],
        "system_multi": ["A1<|im_end|>", "<think>\n\n</think>\n\nA2<|im_end|>"],
        "reasoning_content": ["<think>\nR.\n</think>\n\nA.<|im_end|>"],
        "thinking": ["<think>\nR.\n</think>\n\nA.<|im_end|>"],
        "tools": [
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
            "<think>\n\n</think>\n\nSunny.<|im_end|>",
        ],
        "empty": ["<think>\n\n</think>\n\n<|im_end|>"],
        "parts": ["<think>\n\n</think>\n\nA2<|im_end|>"],
        "trailing_user": ["A1<|im_end|>"],
        "inline_think": ["A1<|im_end|>", "<think>\nR2.\n</think>\n\nA2<|im_end|>"],
    },
    "gemma2": {
        "single": ["Hello there.<end_of_turn>"],
        "system_multi": REFUSED,
        "reasoning_content": ["A.<end_of_turn>"],
        "thinking": ["A.<end_of_turn>"],
        "tools": REFUSED,
        "empty": ["<end_of_turn>"],
        "parts": ["A2<end_of_turn>"],
        "trailing_user": ["A1<end_of_turn>"],
        "inline_think": [INLINE[0] + "<end_of_turn>", INLINE[1] + "<end_of_turn>"],
    },
    "mistral-nemo": {  # the system prompt goes into the last user turn; the first content token is generated
        "single": ["Hello there.</s>"],
        "system_multi": ["A1</s>", "A2</s>"],
        "reasoning_content": ["A.</s>"],
        "thinking": ["A.</s>"],
        "tools": [
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call00001"}]</s>',
            "Sunny.</s>",
        ],
        "empty": ["</s>"],
        "parts": ["A2</s>"],
        "trailing_user": ["A1</s>"],
        "inline_think": [INLINE[0] + "</s>", INLINE[1] + "</s>"],
    },
    "deepseek-r1-distill-llama": {
        "single": ["Hello there." + EOS_DS],
        "system_multi": ["A1" + EOS_DS, "A2" + EOS_DS],
        "reasoning_content": ["A." + EOS_DS],
        "thinking": ["A." + EOS_DS],
        # this template closes a lone tool call with no end-of-turn token: the mask stops at its last field
        "tools": ["<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather", "Sunny." + EOS_DS],
        "empty": [EOS_DS],
        "parts": ["A2" + EOS_DS],
        "trailing_user": ["A1" + EOS_DS],
        "inline_think": ["\n\nA1" + EOS_DS, "\n\nA2" + EOS_DS],
    },
    "mistral-small-3.2": {
        "single": ["Hello there.</s>"],
        "system_multi": ["A1</s>", "A2</s>"],
        "reasoning_content": ["A.</s>"],
        "thinking": ["A.</s>"],
        "tools": ['[TOOL_CALLS]get_weather[CALL_ID]call00001[ARGS]{"city": "Paris"}</s>', "Sunny.</s>"],
        "empty": ["</s>"],
        "parts": ["A2</s>"],
        "trailing_user": ["A1</s>"],
        "inline_think": [INLINE[0] + "</s>", INLINE[1] + "</s>"],
    },
    "mistral-small-3.1": {
        "single": ["Hello there.</s>"],
        "system_multi": ["A1</s>", "A2</s>"],
        "reasoning_content": ["A.</s>"],
        "thinking": ["A.</s>"],
        "tools": [
            '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call00001"}]</s>',
            "Sunny.</s>",
        ],
        "empty": ["</s>"],
        "parts": ["A2</s>"],
        "trailing_user": ["A1</s>"],
        "inline_think": [INLINE[0] + "</s>", INLINE[1] + "</s>"],
    },
}
# What each template does not render as the data has it, by hand from the template text.
R1 = ("deepseek-r1-distill", "deepseek-r1-distill-llama")
UNFAITHFUL = {
    ("qwen3", "system_multi"): [
        "the prompt of assistant turn 2 is not a prefix of the conversation"
    ],  # no think block on past turns
    ("qwen3", "tools"): ["the prompt of assistant turn 1 is not a prefix of the conversation"],
    ("qwen3", "trailing_user"): ["the prompt of assistant turn 1 is not a prefix of the conversation"],
    **{
        (family, case): ["the template does not render the reasoning of assistant turn 1"]
        for family in ("llama3.1", "deepseek-v3.1", "mistral-small-3.1", "mistral-small-3.2")
        for case in ("reasoning_content", "thinking")
    },
    # R1-Distill: the generation prompt opens a think block no rendered turn has, and reasoning is dropped
    **{
        (r1, case): ["the prompt of assistant turn 1 is not a prefix of the conversation"]
        for r1 in R1
        for case in ("single", "tools", "empty", "parts", "trailing_user")
    },
    **{
        (r1, case): [
            "the template does not render the reasoning of assistant turn 1",
            "the prompt of assistant turn 1 is not a prefix of the conversation",
        ]
        for r1 in R1
        for case in ("reasoning_content", "thinking")
    },
    **{
        (r1, "system_multi"): [
            "the prompt of assistant turn 2 is not a prefix of the conversation",
            "the prompt of assistant turn 4 is not a prefix of the conversation",
        ]
        for r1 in R1
    },
    ("deepseek-r1-distill-llama", "tools"): [
        "assistant turn 1 has no end-of-turn token",
        "the prompt of assistant turn 1 is not a prefix of the conversation",
    ],
    ("deepseek-r1-distill-llama", "inline_think"): [
        "the template does not render the reasoning of assistant turn 1",
        "the template does not render the reasoning of assistant turn 3",
        "the prompt of assistant turn 1 is not a prefix of the conversation",
        "the prompt of assistant turn 3 is not a prefix of the conversation",
    ],
    ("qwen3", "inline_think"): [
        "the template does not render the reasoning of assistant turn 1",
        "the prompt of assistant turn 1 is not a prefix of the conversation",
    ],
    ("deepseek-r1-distill", "inline_think"): [
        "the template does not render the reasoning of assistant turn 1",
        "the template does not render the reasoning of assistant turn 3",
        "the prompt of assistant turn 1 is not a prefix of the conversation",
        "the prompt of assistant turn 3 is not a prefix of the conversation",
    ],
    ("deepseek-v3.1", "inline_think"): [
        "the template does not render the reasoning of assistant turn 1",
        "the template does not render the reasoning of assistant turn 3",
    ],
    **{
        ("qwq", case): ["the prompt of assistant turn 1 is not a prefix of the conversation"]
        for case in ("single", "empty", "parts", "trailing_user")
    },
    **{
        ("qwq", case): [
            "the template does not render the reasoning of assistant turn 1",
            "the prompt of assistant turn 1 is not a prefix of the conversation",
        ]
        for case in ("reasoning_content", "thinking", "inline_think")
    },
    ("qwq", "system_multi"): [
        "the prompt of assistant turn 2 is not a prefix of the conversation",
        "the prompt of assistant turn 4 is not a prefix of the conversation",
    ],
    ("qwq", "tools"): [
        "the prompt of assistant turn 1 is not a prefix of the conversation",
        "the prompt of assistant turn 3 is not a prefix of the conversation",
    ],
    **{
        (family, case): ["the template does not render the reasoning of assistant turn 1"]
        for family in ("qwen2.5", "gemma2", "mistral-nemo")
        for case in ("reasoning_content", "thinking")
    },
    **{
        ("smollm3", case): ["the template does not render the reasoning of assistant turn 1"]
        for case in ("reasoning_content", "thinking")
    },
    ("smollm3", "tools"): ["the template does not render the tool call of assistant turn 1"],
    ("qwen3.5", "system_multi"): ["the prompt of assistant turn 2 is not a prefix of the conversation"],
    ("qwen3.5", "trailing_user"): ["the prompt of assistant turn 1 is not a prefix of the conversation"],
    ("qwen3-hybrid", "inline_think"): ["the template does not render the reasoning of assistant turn 1"],
    ("mistral-nemo", "system_multi"): [
        "the prompt of assistant turn 2 is not a prefix of the conversation",
        "the prompt of assistant turn 4 is not a prefix of the conversation",
    ],
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    return request.param, family_tokenizer(FAMILIES[request.param])


def masked_runs(tokenizer, ids, mask) -> list[str]:
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs + ([tokenizer.decode(current)] if current else [])


def encode(tokenizer, record: dict, **kwargs):
    messages, tools = parse_conversation(record, "messages")
    return messages, tools, encode_conversation(tokenizer, messages, tools, kwargs or None)


@pytest.mark.parametrize("case", list(CASES))
def test_mask_of_every_case(family, case):
    name, tokenizer = family
    if EXPECTED[name][case] is REFUSED:
        with pytest.raises(DFlashCacheError, match=REFUSALS[name, case]):
            encode(tokenizer, CASES[case])
        return
    messages, tools, encoded = encode(tokenizer, CASES[case])
    expected, notes = EXPECTED[name][case], UNFAITHFUL.get((name, case), [])
    if (name, case) == ("deepseek-r1-distill-llama", "tools") and not keeps_null_values(tokenizer):
        # Its tool calls render only under a null content, which this transformers leaves out of the messages.
        # The turn is rendered as its markup alone, `<｜Assistant｜><｜end▁of▁sentence｜>`.
        expected = [EOS_DS, "Sunny." + EOS_DS]
        notes = [
            "the template does not render the tool call of assistant turn 1",
            "the prompt of assistant turn 1 is not a prefix of the conversation",
        ]
    assert masked_runs(tokenizer, encoded.input_ids, encoded.loss_mask) == expected
    assert [*encoded.dropped, *encoded.unfaithful] == notes
    assert encoded.dropped == [n for n in notes if "not render" in n]
    if encoded.dropped:
        return
    if name in TEXT_ARGUMENTS:
        messages = [
            {
                **m,
                "tool_calls": [
                    {**c, "function": {**c["function"], "arguments": str(c["function"]["arguments"])}}
                    for c in m["tool_calls"]
                ],
            }
            if m.get("tool_calls")
            else m
            for m in messages
        ]
    try:
        reference = tokenizer.apply_chat_template(messages, tools=tools)["input_ids"]
    except (TypeError, UndefinedError):  # templates that refuse a null content get "" (gpt-oss, QwQ)
        reference = tokenizer.apply_chat_template(
            [{**m, "content": m["content"] or ""} for m in messages], tools=tools
        )["input_ids"]
    assert encoded.input_ids == list(reference)


def keeps_null_values(tokenizer) -> bool:
    """Whether apply_chat_template hands a template the keys whose value is None."""
    return (
        tokenizer.apply_chat_template(
            [{"role": "user", "content": None}], tokenize=False, chat_template="{{ messages[0].content is none }}"
        )
        == "True"
    )


def test_templates_own_refusals_stay_errors():
    llama = family_tokenizer(FAMILIES["llama3.1"])
    two_calls = tool_conversation()
    two_calls["messages"][1]["tool_calls"] *= 2
    with pytest.raises(
        DFlashCacheError,
        match="chat template failed on this conversation: This model only supports single tool-calls at once!",
    ):
        encode(llama, two_calls)


def test_mask_kinds():
    qwen = family_tokenizer(FAMILIES["qwen3"])
    conversation = tool_conversation()
    conversation["messages"][-1]["reasoning_content"] = "It is sunny."
    _, _, encoded = encode(qwen, conversation)
    by_kind = {
        kind: qwen.decode([t for t, k in zip(encoded.input_ids, encoded.kinds) if k == 1 + i])
        for i, kind in enumerate(KINDS)
    }
    assert by_kind == {
        "reasoning": "It is sunny.",
        "content": "Sunny.",
        "tool_call": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "markup": "<|im_end|>\n</think>\n\n<|im_end|>",
    }


def test_template_options_change_the_generation_prompt():
    """DeepSeek-V3.1 with thinking on: its prompt opens a think block; past turns render without it."""
    deepseek = family_tokenizer(FAMILIES["deepseek-v3.1"])
    _, _, off = encode(deepseek, CASES["system_multi"])
    _, _, on = encode(deepseek, CASES["system_multi"], thinking=True)
    assert off.input_ids == on.input_ids  # the training text does not change ...
    assert masked_runs(deepseek, on.input_ids, on.loss_mask) == ["</think>A1" + EOS_DS, "</think>A2" + EOS_DS]
    assert on.unfaithful == [
        "the prompt of assistant turn 2 is not a prefix of the conversation",
        "the prompt of assistant turn 4 is not a prefix of the conversation",
    ]
