"""`FeatureBatch`: what both the cache stream and a live target hand to the drafter."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class FeatureBatch:
    """Several samples packed end to end along one token axis (no padding).

    `hidden` holds the captured target layers concatenated along the feature axis, in the order of
    the cache's layer list: column block i is layer `layer_ids[i]`.
    """

    sample_ids: list[int]
    input_ids: torch.Tensor  # [N] int64
    loss_mask: torch.Tensor  # [N] bool
    target_ids: torch.Tensor  # [N] int64: the target's argmax next token at every position
    hidden: torch.Tensor  # [N, L*H] bf16
    cu_seqlens: torch.Tensor  # [S+1] int32, offsets of each sample in the packed axis
    # The target's top-K next tokens and their log-probabilities at every position, when asked for
    topk_ids: torch.Tensor | None = None  # [N, K] int64
    topk_logprobs: torch.Tensor | None = None  # [N, K] fp32

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_sequences(self) -> int:
        return len(self.sample_ids)

    def position_ids(self) -> torch.Tensor:
        """Position of every token inside its own sample, [N] int64."""
        lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()
        # output_size: without it repeat_interleave waits for the GPU to learn its length
        starts = torch.repeat_interleave(self.cu_seqlens[:-1].long(), lengths, output_size=self.num_tokens)
        return torch.arange(self.num_tokens, device=self.input_ids.device) - starts

    def sequence_ids(self) -> torch.Tensor:
        """Index of the sample each token belongs to, [N] int64."""
        lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()
        return torch.repeat_interleave(
            torch.arange(len(lengths), device=lengths.device), lengths, output_size=self.num_tokens
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> FeatureBatch:
        return self.apply(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> FeatureBatch:
        return self.apply(torch.Tensor.pin_memory)

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> FeatureBatch:
        """The batch with `fn` applied to each of its tensors."""
        return FeatureBatch(
            sample_ids=self.sample_ids,
            input_ids=fn(self.input_ids),
            loss_mask=fn(self.loss_mask),
            target_ids=fn(self.target_ids),
            hidden=fn(self.hidden),
            cu_seqlens=fn(self.cu_seqlens),
            topk_ids=None if self.topk_ids is None else fn(self.topk_ids),
            topk_logprobs=None if self.topk_logprobs is None else fn(self.topk_logprobs),
        )
