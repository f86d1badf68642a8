"""Padded extraction on a fixed set of shapes, for targets that cannot run packed rows exactly.

Samples are grouped by the length buckets of data/plan.py, computed from `--max-length` (not from
the data), and every batch of bucket k has the same shape (B_k, T_k): T_k the bucket's upper bound
rounded up to a multiple of 8, B_k = token_budget // T_k samples (at least 1). The last batch of a
bucket is filled up with empty rows. A batch split after an out-of-memory error runs its halves on
ceil(B_k / 2), ceil(B_k / 4), ... rows. A run therefore sees at most one shape per bucket, about
2 log2(max_length / 64) + 2 shapes (16 for 8192), whatever the data.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from dflash_cache.data.dataset import Sample
from dflash_cache.data.plan import Batches, length_buckets
from dflash_cache.target.batch import ForwardBatch, padded_rows


@dataclass(frozen=True)
class BucketLayout:
    token_budget: int
    max_length: int
    attention = "sdpa"

    @cached_property
    def _bounds(self) -> list[int]:
        return length_buckets(self.max_length)

    def shapes(self) -> list[tuple[int, int]]:
        """(B_k, T_k) of every bucket, longest first."""
        return [self._bucket_shape(b) for b in self._bounds[:0:-1]]

    def describe(self) -> str:
        return f"padded batches of {len(self.shapes())} fixed shapes (token budget {self.token_budget})"

    def warmup_samples(self, sequence: int = 0) -> list[Sample]:
        return []  # each shape is compiled when first met: warming all of them would cost more than it saves

    def _bucket_shape(self, upper: int) -> tuple[int, int]:
        seq = -(-(upper - 1) // 8) * 8
        return max(1, self.token_budget // seq), seq

    def _upper(self, length: int) -> int:
        return self._bounds[bisect.bisect_right(self._bounds, length)]

    def plan(self, sample_ids: Sequence[int], lengths: Sequence[int]) -> Batches:
        """Buckets from long to short, samples by (length, id) inside one."""
        ids, lens = np.asarray(sample_ids, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
        if len(lens) and lens.max() > self.max_length:
            raise ValueError(f"a sample of {int(lens.max())} tokens is over the max length {self.max_length}")
        upper = np.asarray(self._bounds)[np.searchsorted(self._bounds, lens, side="right")]
        order = np.lexsort((ids, lens, -upper))
        uppers, first, counts = np.unique(-upper[order], return_index=True, return_counts=True)
        starts = [np.arange(f, f + c, self._bucket_shape(-u)[0]) for u, f, c in zip(uppers.tolist(), first, counts)]
        return Batches(ids[order], np.concatenate([*starts, [len(ids)]]))

    def shape(self, lengths: list[int], halvings: int = 0) -> tuple[int, int]:
        """The input shape of a batch of samples of these lengths."""
        size, seq = self._bucket_shape(self._upper(max(lengths)))
        return -(-size // 2**halvings), seq  # a half of n samples has at most ceil(n / 2)

    def build(self, samples: list[Sample], device: torch.device | str, halvings: int = 0) -> ForwardBatch:
        return padded_rows(samples, self.shape([len(s.input_ids) for s in samples], halvings), device)
