"""Real chat templates of model families (tests/fixtures/templates, sources in SOURCES.md) on the tiny
tokenizer, with each family's added tokens."""

from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken

from tests.support.tiny import build_tokenizer

TEMPLATES = Path(__file__).parents[1] / "fixtures" / "templates"
DEEPSEEK_TOKENS = [
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
]


@dataclass(frozen=True)
class Family:
    template: str
    special: list[str]
    plain: list[str]  # added tokens that are not special (Qwen's <think>, <tool_call>...)
    eos: str
    bos: str | None = None


QWEN_SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
QWEN_PLAIN = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
FAMILIES = {
    "qwen3": Family("qwen3-4b-thinking-2507.jinja", QWEN_SPECIAL, QWEN_PLAIN, "<|im_end|>"),
    "gpt-oss": Family(
        "gpt-oss-20b.jinja",
        [
            "<|start|>",
            "<|end|>",
            "<|message|>",
            "<|channel|>",
            "<|return|>",
            "<|call|>",
            "<|constrain|>",
            "<|startoftext|>",
            "<|endoftext|>",
        ],
        [],
        "<|return|>",
        "<|startoftext|>",
    ),
    "llama3.1": Family(
        "llama-3.1-instruct.jinja",
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
        [],
        "<|eot_id|>",
        "<|begin_of_text|>",
    ),
    "deepseek-r1-distill": Family(
        "deepseek-r1-distill-qwen-32b.jinja",
        DEEPSEEK_TOKENS,
        ["<think>", "</think>"],
        "<｜end▁of▁sentence｜>",
        "<｜begin▁of▁sentence｜>",
    ),
    "deepseek-v3.1": Family(
        "deepseek-v3.1.jinja",
        DEEPSEEK_TOKENS,
        ["<think>", "</think>"],
        "<｜end▁of▁sentence｜>",
        "<｜begin▁of▁sentence｜>",
    ),
    "qwen3.5": Family("qwen3.5-4b.jinja", QWEN_SPECIAL, QWEN_PLAIN, "<|im_end|>"),
    "qwq": Family("qwq-32b.jinja", QWEN_SPECIAL, QWEN_PLAIN, "<|im_end|>"),
    "qwen2.5": Family("qwen2.5-7b-instruct.jinja", QWEN_SPECIAL, QWEN_PLAIN, "<|im_end|>"),
    "qwen3-hybrid": Family("qwen3-0.6b.jinja", QWEN_SPECIAL, QWEN_PLAIN, "<|im_end|>"),
    "gemma2": Family(
        "gemma-2-2b-it.jinja", ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], [], "<eos>", "<bos>"
    ),
    "mistral-nemo": Family(
        "mistral-nemo-instruct-2407.jinja",
        [
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ],
        [],
        "</s>",
        "<s>",
    ),
    "deepseek-r1-distill-llama": Family(
        "deepseek-r1-distill-llama-8b.jinja",
        DEEPSEEK_TOKENS,
        ["<think>", "</think>"],
        "<｜end▁of▁sentence｜>",
        "<｜begin▁of▁sentence｜>",
    ),
    "mistral-small-3.2": Family(
        "mistral-small-3.2-24b-instruct-2506.jinja",
        [
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[SYSTEM_PROMPT]",
            "[/SYSTEM_PROMPT]",
            "[TOOL_CALLS]",
            "[CALL_ID]",
            "[ARGS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
            "[TOOL_CONTENT]",
        ],
        [],
        "</s>",
        "<s>",
    ),
    "smollm3": Family("smollm3-3b.jinja", QWEN_SPECIAL, QWEN_PLAIN, "<|im_end|>"),
    "mistral-small-3.1": Family(
        "mistral-small-3.1-24b-instruct-2503.jinja",
        [
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[SYSTEM_PROMPT]",
            "[/SYSTEM_PROMPT]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ],
        [],
        "</s>",
        "<s>",
    ),
}


def family_tokenizer(family: Family):
    tokenizer = build_tokenizer(chat_template=(TEMPLATES / family.template).read_text())
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in family.special], special_tokens=True)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.plain])
    tokenizer.eos_token = family.eos
    if family.bos:
        tokenizer.bos_token = family.bos
    return tokenizer
