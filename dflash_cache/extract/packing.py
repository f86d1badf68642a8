"""Packed extraction: samples concatenated into rows of exactly `row_tokens` tokens, so the target
runs on one input shape for the whole run, whatever the data (kernels are compiled and autotuned
once, not once per batch shape), and computes no padding except at the end of a row.

Each sample sees only itself: the row carries the sample boundaries (`cu_seqlens`) and positions
restarting at 0, which every layer honours (target/varlen.py).

The plan fills rows greedily: a row starts with the longest sample left, then takes the longest
sample that still fits until none does. Rows come out from long samples to short (an
out-of-memory row shows first; the last rows hold short samples that compress in parallel), nearly
full until the last, and the plan is a pure function of (ids, lengths, row_tokens).
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dflash_cache.data.dataset import Sample
from dflash_cache.data.plan import Batches
from dflash_cache.target.batch import ForwardBatch, to_device
from dflash_cache.target.varlen import ATTENTION

ROUND = 64  # a row cut by an out-of-memory split keeps a length in multiples of this
WARMUP_SEQUENCE = 2048  # the warm-up row is cut into sequences of this length, like real data


def plan_rows(sample_ids: Sequence[int], lengths: Sequence[int], row_tokens: int) -> Batches:
    """Rows of sample ids; every sample must fit a row (lengths[i] <= row_tokens)."""
    ids, lens = np.asarray(sample_ids, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    if len(lens) and lens.max() > row_tokens:
        raise ValueError(f"a sample of {int(lens.max())} tokens does not fit a row of {row_tokens}")
    # By length, then by id from high to low: samples of length n are positions first[n] .. end[n] - 1,
    # taken from the end, so the smallest id first.
    order = np.lexsort((-ids, lens))
    ordered = lens[order]
    bounds = np.flatnonzero(np.diff(ordered, prepend=-1)).tolist()
    sizes = ordered[bounds].tolist()  # distinct lengths still available
    del ordered
    ends = bounds[1:] + [len(ids)]
    taken, starts = array("q"), array("q", [0])
    while sizes:
        room = row_tokens
        while (i := bisect.bisect_right(sizes, room) - 1) >= 0:
            ends[i] -= 1
            taken.append(ends[i])
            room -= sizes[i]
            if ends[i] == bounds[i]:
                del sizes[i], bounds[i], ends[i]
        starts.append(len(taken))
    return Batches(ids[order[np.frombuffer(taken, dtype=np.int64)]], np.frombuffer(starts, dtype=np.int64))


@dataclass(frozen=True)
class PackedLayout:
    row_tokens: int
    attention = ATTENTION  # the target's attention implementation for these rows

    def describe(self) -> str:
        return f"packed rows of {self.row_tokens} tokens (one input shape)"

    def warmup_samples(self, sequence: int = WARMUP_SEQUENCE) -> list[Sample]:
        """Dummy samples of `sequence` tokens filling one row: its one shape compiled before the first real row."""
        full, rest = divmod(self.row_tokens, sequence)
        sizes = [sequence] * full + ([rest] if rest else [])
        return [Sample(-1 - i, np.zeros(n, dtype=np.int32), np.ones(n, dtype=bool)) for i, n in enumerate(sizes)]

    def plan(self, sample_ids: Sequence[int], lengths: Sequence[int]) -> Batches:
        return plan_rows(sample_ids, lengths, self.row_tokens)

    def shape(self, lengths: list[int], halvings: int = 0) -> tuple[int, int]:
        """The input shape of a batch of samples of these lengths: one row of `row_tokens`, or of
        a halved width (at least their tokens, rounded up) after out-of-memory splits."""
        used = sum(lengths)
        width = max(self.row_tokens >> halvings, -(-used // ROUND) * ROUND) if halvings else self.row_tokens
        if used > width:
            raise ValueError(f"{used} tokens do not fit a row of {width}")
        return 1, width

    def build(self, samples: list[Sample], device: torch.device | str, halvings: int = 0) -> ForwardBatch:
        lengths = torch.tensor([len(s.input_ids) for s in samples], dtype=torch.long)
        used = int(lengths.sum())
        width = self.shape(lengths.tolist(), halvings)[1]
        ids = torch.zeros(1, width, dtype=torch.long)
        ids[0, :used] = torch.from_numpy(np.concatenate([s.input_ids for s in samples]).astype(np.int64))
        # The padding tail is cut into sequences of its own, ROUND tokens each: nothing attends across
        # it, and it costs no more than its tokens (one long tail sequence would cost its square in
        # attention where attention is computed per sequence, as on the CPU).
        tail, rest = divmod(width - used, ROUND)
        bounds = lengths.tolist() + [ROUND] * tail + ([rest] if rest else [])
        cu = torch.zeros(len(bounds) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(bounds, dtype=torch.int32).cumsum(0)
        starts = cu[: len(samples)].long()
        positions = torch.cat([torch.arange(n) for n in bounds]).unsqueeze(0)
        return ForwardBatch(
            sample_ids=[s.sample_id for s in samples],
            input_ids=to_device(ids, device),
            lengths=lengths,
            rows=torch.zeros(len(samples), dtype=torch.long),
            starts=starts,
            position_ids=to_device(positions, device),
            cu_seqlens=to_device(cu, device),
            cu_seqlens_cpu=cu,
            max_seqlen=max(bounds),
        )
