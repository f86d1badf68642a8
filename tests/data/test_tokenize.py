import json

import pytest

from dflash_cache.data.tokenize import tokenize_conversation
from dflash_cache.errors import DFlashCacheError
from tests.support.tiny import build_tokenizer

LLAMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
# Like Qwen3: only the last assistant turn gets an (empty) thinking block, so a turn renders
# differently once later turns follow it.
THINKING_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' and loop.last %}"
    "{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

EDGE_CASES = [
    # contents beginning or ending with the probe letters, an empty reply, tool turns
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "XY are letters X"}],
    [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Y then X then Y"},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": ""},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "add 2 and 3"},
        {"role": "assistant", "content": "calling add"},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "The answer is 5."},
    ],
    # an assistant turn first, and two assistant turns in a row
    [
        {"role": "assistant", "content": "hello, how are you?"},
        {"role": "assistant", "content": "still there?"},
        {"role": "user", "content": "yes"},
    ],
]


@pytest.fixture(scope="module")
def llama_tokenizer():
    tok = build_tokenizer(chat_template=LLAMA_TEMPLATE)
    tok.add_special_tokens(
        {
            "bos_token": "<|begin_of_text|>",
            "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        }
    )
    return tok


def all_conversations(conversations_path):
    with open(conversations_path) as f:
        return [json.loads(line)["messages"] for line in f] + EDGE_CASES


def masked_text(tokenizer, ids, mask):
    return tokenizer.decode([t for t, m in zip(ids, mask) if m])


def check(tokenizer, messages, expected_masked):
    ids, mask = tokenize_conversation(tokenizer, messages)
    assert ids == list(tokenizer.apply_chat_template(messages)["input_ids"])
    assert len(mask) == len(ids) and set(mask) <= {0, 1}
    assert masked_text(tokenizer, ids, mask) == expected_masked
    # one contiguous run per assistant turn (consecutive turns may touch)
    runs = sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))
    assert 1 <= runs <= sum(m["role"] == "assistant" for m in messages)


def test_qwen_like_template(tokenizer, conversations):
    for messages in all_conversations(conversations):
        expected = "".join(m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant")
        check(tokenizer, messages, expected)


def test_llama_like_template_with_trimmed_content(llama_tokenizer, conversations):
    padded = [[{**m, "content": f"  {m['content']} \n"} for m in messages] for messages in EDGE_CASES]
    for messages in all_conversations(conversations) + padded:
        expected = "".join(m["content"].strip() + "<|eot_id|>" for m in messages if m["role"] == "assistant")
        check(llama_tokenizer, messages, expected)


def test_template_that_renders_the_last_turn_differently(conversations):
    tokenizer = build_tokenizer(chat_template=THINKING_TEMPLATE)
    for messages in all_conversations(conversations):
        parts = []
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                think = "<think>\n\n</think>\n\n" if i == len(messages) - 1 else ""
                parts.append(think + m["content"] + "<|im_end|>")
        check(tokenizer, messages, "".join(parts))


def test_exact_mask_positions(tokenizer):
    """The mask, position by position, against a tokenization built piece by piece."""
    messages = EDGE_CASES[2]
    expected_ids, expected_mask = [], []
    for m in messages:
        assistant = m["role"] == "assistant"
        for piece, masked in [
            (f"<|im_start|>{m['role']}\n", False),
            (m["content"], assistant),
            ("<|im_end|>", assistant),
            ("\n", False),
        ]:
            piece_ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
            expected_ids += piece_ids
            expected_mask += [int(masked)] * len(piece_ids)
    assert tokenize_conversation(tokenizer, messages) == (expected_ids, expected_mask)


def test_no_chat_template():
    tokenizer = build_tokenizer(chat_template=None)
    with pytest.raises(DFlashCacheError, match="no chat template"):
        tokenize_conversation(tokenizer, EDGE_CASES[0])


def test_template_error_is_a_user_error():
    tokenizer = build_tokenizer(chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(DFlashCacheError, match="chat template failed on this conversation: roles must alternate"):
        tokenize_conversation(tokenizer, EDGE_CASES[0])


def test_template_that_rewrites_history():
    # Every turn changes once a later turn exists, so no prefix render matches the full render:
    # the mask still covers each assistant content and the token after it.
    template = (
        "{%- for m in messages %}{{ m['role'] + (messages | length | string) + ':' + m['content'] + '<|im_end|>' }}"
        "{%- endfor %}{%- if add_generation_prompt %}{{ 'assistant:' }}{%- endif %}"
    )
    tokenizer = build_tokenizer(chat_template=template)
    for messages in EDGE_CASES:
        expected = "".join(m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant")
        check(tokenizer, messages, expected)


@pytest.mark.parametrize("template", [None, THINKING_TEMPLATE])
def test_renders_per_conversation_do_not_grow_with_turns(template):
    """Span finding renders a conversation a fixed number of times, whatever its number of turns."""
    tokenizer = build_tokenizer() if template is None else build_tokenizer(chat_template=template)
    counts = []
    for turns in (2, 8, 64):
        messages = [{"role": "user" if t % 2 == 0 else "assistant", "content": f"turn {t} text"} for t in range(turns)]
        tokenize_conversation(tokenizer, messages)  # the template's one-off calibration
        calls = [0]
        original = tokenizer.apply_chat_template
        tokenizer.apply_chat_template = lambda *a, **k: (calls.__setitem__(0, calls[0] + 1), original(*a, **k))[1]
        try:
            tokenize_conversation(tokenizer, messages)
        finally:
            tokenizer.apply_chat_template = original
        counts.append(calls[0])
    assert counts == [
        3,
        4,
        4,
    ]  # the conversation, the probe, the first and last turns' prompts (one when they are the same)
