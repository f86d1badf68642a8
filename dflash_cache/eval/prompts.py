"""Held-out prompts: each record's tokens up to its first assistant token.

Records are tokenized as for extraction (the chat template, the assistant-only loss mask), so a
conversation's prompt is its rendering up to and including the generation prompt of its first
assistant turn, and a pre-tokenized record's prompt is its tokens before the first loss-masked one.
A prompt-only conversation (no assistant turn) is rendered whole with the generation prompt.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dflash_cache.data.dataset import checked_inputs, encode_record
from dflash_cache.data.readers import Conversation, read_records
from dflash_cache.errors import DFlashCacheError


def load_prompts(
    paths: list[str | Path], tokenizer, num_prompts: int | None = None, max_length: int = 8192
) -> list[list[int]]:
    """The prompts of the first `num_prompts` records that have one (all of them when None).

    Records are read and tokenized one by one in this process, and reading stops once enough
    prompts are found: a prompt set is small, read once, and not worth a kept tokenized copy."""
    paths, options = checked_inputs(paths, max_length, None, "error")
    vocab_size = len(tokenizer)
    prompts: list[list[int]] = []
    for path in paths:
        for record in read_records(path, max_line_bytes=options.record_bytes(), prompts=True):
            try:
                if isinstance(record, Conversation) and not any(m["role"] == "assistant" for m in record.messages):
                    prompt = tokenizer.apply_chat_template(
                        record.messages,
                        tools=record.tools,
                        add_generation_prompt=True,
                        tokenize=True,
                        return_dict=True,
                        **(options.template_kwargs or {}),
                    )["input_ids"][:max_length]
                else:
                    encoded = encode_record(tokenizer, vocab_size, record, options)
                    first = int(np.argmax(encoded.loss_mask)) if encoded.loss_mask.any() else 0
                    prompt = encoded.input_ids[:first].tolist()
            except DFlashCacheError as e:
                raise DFlashCacheError(f"{record.where}: {e}") from None
            if prompt:
                prompts.append(prompt)
            if num_prompts is not None and len(prompts) == num_prompts:
                return prompts
    if not prompts:
        raise DFlashCacheError(f"{', '.join(map(str, paths))}: no record has a prompt.")
    return prompts
