"""Survive an out-of-memory batch by running it again in halves, down to single samples."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dflash_cache.data.dataset import Sample
from dflash_cache.errors import DFlashCacheError
from dflash_cache.target.batch import ForwardBatch, Layout
from dflash_cache.target.runner import TargetOutput, TargetRunner


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
    """The outputs of one forward: a whole planned batch, or a piece of one cut after an OOM."""

    batch: ForwardBatch
    output: TargetOutput

    @property
    def sample_ids(self) -> list[int]:
        return self.batch.sample_ids


def run_with_split(
    runner: TargetRunner, layout: Layout, samples: list[Sample], device: torch.device | str, halvings: int = 0
) -> Iterator[Part]:
    """Yield the batch's outputs in sample order: whole if it fits, else from halves, recursively
    (each half built by the layout in a shape that shrinks with the number of halvings).

    Yielding part by part lets the caller hand each one off before the next runs, so a split batch
    never holds more than one part's outputs at a time.
    """
    batch = layout.build(samples, device, halvings)
    try:
        output = runner.run_batch(batch)
    except torch.cuda.OutOfMemoryError:
        output = None
    # Retry outside the except block: its traceback would keep the failed forward's tensors alive.
    if output is not None:
        yield Part(batch, output)
        return
    del batch
    if len(samples) == 1:
        raise SampleOutOfMemory(samples[0].sample_id, len(samples[0].input_ids))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    half = len(samples) // 2
    for part in (samples[:half], samples[half:]):
        yield from run_with_split(runner, layout, part, device, halvings + 1)
