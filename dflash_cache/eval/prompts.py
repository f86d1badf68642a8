"""Held-out prompts: each record's tokens up to its first assistant token.

Records are tokenized as for extraction (the chat template, the assistant-only loss mask), so a
conversation's prompt is its rendering up to and including the generation prompt of its first
assistant turn, and a pre-tokenized record's prompt is its tokens before the first loss-masked one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dflash_cache.data.dataset import LoadedData, checked_inputs, stream_samples
from dflash_cache.errors import DFlashCacheError


def load_prompts(paths: list[str | Path], tokenizer, num_prompts: int | None = None, max_length: int = 8192) -> list[list[int]]:
    """The prompts of the first `num_prompts` records that have one (all of them when None).

    Records stream through the tokenizer in this process and stop once enough prompts are found: a
    prompt set is small, read once, and not worth a kept tokenized copy (data/tokenized.py)."""
    paths, options = checked_inputs(paths, max_length, None, "error")
    prompts: list[list[int]] = []
    for chunk in stream_samples(LoadedData([], 0, ""), paths, tokenizer, options, workers=0, on_bad_record="error"):
        for sample in chunk:
            first = int(np.argmax(sample.loss_mask)) if sample.loss_mask.any() else 0
            if first > 0:
                prompts.append(sample.input_ids[:first].tolist())
            if num_prompts is not None and len(prompts) == num_prompts:
                return prompts
    if not prompts:
        raise DFlashCacheError(f"{', '.join(map(str, paths))}: no record has a prompt followed by an assistant turn.")
    return prompts
