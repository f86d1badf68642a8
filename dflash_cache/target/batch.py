"""One target forward's input, and where each of its samples lies in it.

Two layouts build these (extract/packing.py, extract/buckets.py): packed rows, where samples follow
one another in a single row and `cu_seqlens` marks their boundaries, and padded batches, one sample
per row from position 0. Either way sample i occupies positions `starts[i]` to `starts[i] +
lengths[i]` of row `rows[i]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from dflash_cache.data.dataset import Sample
from dflash_cache.data.plan import Batches


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device: a copy from pageable memory would
    wait for every kernel queued before it, so the tensor is pinned first."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class ForwardBatch:
    sample_ids: list[int]
    input_ids: torch.Tensor  # [B, T] int64 on the target's device
    lengths: torch.Tensor  # [n] int64 on the CPU, one per sample
    rows: torch.Tensor  # [n] int64 on the CPU
    starts: torch.Tensor  # [n] int64 on the CPU
    position_ids: torch.Tensor | None = None  # [1, T] restarting at every sample (packed)
    cu_seqlens: torch.Tensor | None = None  # [S + 1] int32 on the device: samples, then the padding tail
    cu_seqlens_cpu: torch.Tensor | None = None
    max_seqlen: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)

    def token_offsets(self) -> torch.Tensor:
        """[n] int64 CPU: each sample's first token in the flattened [B * T] batch."""
        return self.rows * self.input_ids.shape[1] + self.starts

    def real_tokens(self) -> torch.Tensor:
        """[sum(lengths)] int64 CPU: the flat index of every real token, sample after sample."""
        return torch.cat([torch.arange(int(o), int(o + n)) for o, n in zip(self.token_offsets(), self.lengths)])

    def forward_kwargs(self) -> dict:
        """What the model's forward takes besides input_ids (target/varlen.py reads the lengths)."""
        if self.cu_seqlens is None:
            return {}
        return {
            "position_ids": self.position_ids,
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_seqlen,
            "max_length_k": self.max_seqlen,
            "cu_seq_lens_cpu": self.cu_seqlens_cpu,
        }


def padded_rows(samples: list[Sample], shape: tuple[int, int], device: torch.device | str) -> ForwardBatch:
    """One sample per row, right-padded with zeros to `shape` (rows past the samples are all padding)."""
    batch, seq = shape
    lengths = torch.tensor([len(s.input_ids) for s in samples], dtype=torch.long)
    if len(samples) > batch or int(lengths.max()) > seq:
        raise ValueError(f"{len(samples)} samples of up to {int(lengths.max())} tokens do not fit a batch of {shape}")
    ids = torch.zeros(batch, seq, dtype=torch.long)
    for b, s in enumerate(samples):
        ids[b, : len(s.input_ids)] = torch.from_numpy(s.input_ids.astype(np.int64))
    n = len(samples)
    return ForwardBatch(
        [s.sample_id for s in samples],
        to_device(ids, device),
        lengths,
        torch.arange(n),
        torch.zeros(n, dtype=torch.long),
    )


class Layout(Protocol):
    """How samples become target forwards: a plan of batches, and each batch's input."""

    attention: str  # the attention implementation the target is loaded with

    def describe(self) -> str: ...
    def plan(self, sample_ids: Sequence[int], lengths: Sequence[int]) -> Batches: ...
    def warmup_samples(self, sequence: int = ...) -> list[Sample]: ...
    def shape(self, lengths: list[int], halvings: int = 0) -> tuple[int, int]: ...
    def build(self, samples: list[Sample], device: torch.device | str, halvings: int = 0) -> ForwardBatch:
        """`halvings` > 0: the batch is a part of a planned one cut in two that many times after an
        out-of-memory error; its shape shrinks accordingly."""
        ...
