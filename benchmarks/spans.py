"""Cost of finding the generated spans of a conversation, against a plain encode of the same text.

    python benchmarks/spans.py [--turns 64] [--tokens-per-turn 150] [--repeats 20]

For the bundled example tokenizer with its own template and with the Qwen3 fixture template
(reasoning on every assistant turn), prints the renders per conversation and the time of
`encode_conversation` (render, probe render, prompt checks, encode with offsets, masks) divided by
the time of `tokenizer(text)` on the rendered text. CPU only; one JSON line per template.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tokenizers import AddedToken
from transformers import AutoTokenizer

from dflash_cache.data.tokenize import encode_conversation

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "examples" / "assets" / "target"
QWEN3 = ROOT / "tests" / "fixtures" / "templates" / "qwen3-4b-thinking-2507.jinja"


def conversation(words: list[str], turns: int, words_per_turn: int, reasoning: bool) -> list[dict]:
    messages = []
    for t in range(turns):
        text = " ".join(words[(t * words_per_turn + i) % len(words)] for i in range(words_per_turn))
        role = "user" if t % 2 == 0 else "assistant"
        message = {"role": role, "content": text}
        if reasoning and role == "assistant":
            message["reasoning_content"] = text[: len(text) // 3]
        messages.append(message)
    return messages


def best_of(repeats: int, fn) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(tokenizer, messages: list[dict], repeats: int, label: str) -> dict:
    renders = [0]
    original = tokenizer.apply_chat_template

    def counting(*args, **kwargs):
        renders[0] += 1
        return original(*args, **kwargs)

    encode_conversation(tokenizer, messages)  # warm the per-template cache
    tokenizer.apply_chat_template = counting
    encoded = encode_conversation(tokenizer, messages)
    tokenizer.apply_chat_template = original
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    plain = best_of(repeats, lambda: tokenizer(text, add_special_tokens=False))
    spans = best_of(repeats, lambda: encode_conversation(tokenizer, messages))
    return {
        "template": label,
        "messages": len(messages),
        "tokens": len(encoded.input_ids),
        "renders": renders[0],
        "plain_encode_ms": round(plain * 1e3, 3),
        "encode_conversation_ms": round(spans * 1e3, 3),
        "ratio": round(spans / plain, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=64)
    parser.add_argument("--tokens-per-turn", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(TARGET, local_files_only=True)
    words = " ".join(
        json.loads(line)["messages"][-1]["content"]
        for line in (TARGET.parent / "data" / "train.jsonl").read_text().splitlines()[:200]
    ).split()
    probe = " ".join(words[:1000])
    words_per_turn = max(1, round(args.tokens_per_turn * 1000 / len(tokenizer(probe)["input_ids"])))
    print(
        json.dumps(measure(tokenizer, conversation(words, args.turns, words_per_turn, False), args.repeats, "bundled"))
    )
    tokenizer.chat_template = QWEN3.read_text()
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    print(
        json.dumps(
            measure(tokenizer, conversation(words, args.turns, words_per_turn, True), args.repeats, "qwen3 fixture")
        )
    )


if __name__ == "__main__":
    main()
