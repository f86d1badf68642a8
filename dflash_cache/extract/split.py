"""Survive an out-of-memory batch by running it again in halves, down to single samples."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dflash_cache.errors import DFlashCacheError
from dflash_cache.extract.runner import TargetOutput, TargetRunner


class SampleOutOfMemory(DFlashCacheError):
    def __init__(self, sample_id: int, num_tokens: int):
        super().__init__(
            f"sample {sample_id} ({num_tokens} tokens) does not fit in GPU memory even alone; "
            "lower --max-length or use a GPU with more memory"
        )
        self.sample_id = sample_id
        self.num_tokens = num_tokens


@dataclass
class Part:
    """The outputs for a contiguous slice of the batch, trimmed to its own longest sample."""

    sample_ids: list[int]
    lengths: torch.Tensor  # [b]
    output: TargetOutput  # tensors [b, t, ...], t = max(lengths)


def run_with_split(
    runner: TargetRunner, input_ids: torch.Tensor, lengths: torch.Tensor, sample_ids: list[int]
) -> Iterator[Part]:
    """Yield the batch's outputs in sample order: whole if it fits, else from halves, recursively.

    Yielding part by part lets the caller hand each one off before the next runs, so a split batch
    never holds more than one part's outputs at a time.
    """
    try:
        output = runner.run(input_ids, lengths)
    except torch.cuda.OutOfMemoryError:
        output = None
    # Retry outside the except block: its traceback would keep the failed forward's tensors alive.
    if output is not None:
        yield Part(sample_ids, lengths, output)
        return
    if len(sample_ids) == 1:
        raise SampleOutOfMemory(sample_ids[0], int(lengths[0]))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    half = len(sample_ids) // 2
    for part in (slice(0, half), slice(half, None)):
        sub_lengths = lengths[part]
        longest = int(sub_lengths.max())
        yield from run_with_split(runner, input_ids[part, :longest], sub_lengths, sample_ids[part])
