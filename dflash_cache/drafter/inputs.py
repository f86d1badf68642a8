"""`DraftInputs`: one training step's tensors, with per-token positions and sequence ids worked out
ahead of the drafter's forward so that nothing in it depends on the number of sequences."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_cache.errors import DFlashCacheError
from dflash_cache.stream.batch import FeatureBatch


@dataclass
class DraftInputs:
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool
    target_ids: torch.Tensor  # [T] int64
    hidden: torch.Tensor  # [T, L*H]
    positions: torch.Tensor  # [T] int64, position inside the token's own sequence
    seq_ids: torch.Tensor  # [T] int64
    anchors: torch.Tensor  # [A] int64 packed indices, sorted
    topk_ids: torch.Tensor | None = None  # [T, K] int64, the target's top-K next tokens (when loaded)
    topk_logprobs: torch.Tensor | None = None  # [T, K] fp32

    @classmethod
    def build(cls, batch: FeatureBatch, anchors: torch.Tensor) -> DraftInputs:
        return cls(
            input_ids=batch.input_ids,
            loss_mask=batch.loss_mask,
            target_ids=batch.target_ids,
            hidden=batch.hidden,
            positions=batch.position_ids(),
            seq_ids=batch.sequence_ids(),
            anchors=anchors.long(),
            topk_ids=batch.topk_ids,
            topk_logprobs=batch.topk_logprobs,
        )

    def padded(self, token_budget: int, anchor_budget: int, block_size: int) -> DraftInputs:
        """Fixed shapes for the compiled drafter: `token_budget + block_size` tokens, `anchor_budget` anchors.

        The padding is one extra sequence with no loss-masked token; padding anchors sit at its start,
        so their blocks see only padding and add nothing to the loss or the metrics.
        """
        n, a = self.input_ids.shape[0], self.anchors.shape[0]
        if n > token_budget or a > anchor_budget:
            raise DFlashCacheError(
                f"a batch of {n} tokens and {a} anchors exceeds the compiled drafter's budget of {token_budget} "
                f"tokens and {anchor_budget} anchors; raise the budgets or make batches smaller."
            )
        pad = token_budget + block_size - n

        def zeros(t: torch.Tensor) -> torch.Tensor:
            return t.new_zeros((pad, *t.shape[1:]))

        next_sequence = self.seq_ids[-1:] + 1 if n else self.seq_ids.new_zeros(1)
        return DraftInputs(
            input_ids=torch.cat([self.input_ids, zeros(self.input_ids)]),
            loss_mask=torch.cat([self.loss_mask, zeros(self.loss_mask)]),
            target_ids=torch.cat([self.target_ids, zeros(self.target_ids)]),
            hidden=torch.cat([self.hidden, zeros(self.hidden)]),
            positions=torch.cat([self.positions, torch.arange(pad, device=self.positions.device)]),
            seq_ids=torch.cat([self.seq_ids, next_sequence.expand(pad)]),
            anchors=torch.cat([self.anchors, self.anchors.new_full((anchor_budget - a,), n)]),
            topk_ids=None if self.topk_ids is None else torch.cat([self.topk_ids, zeros(self.topk_ids)]),
            topk_logprobs=None
            if self.topk_logprobs is None
            else torch.cat([self.topk_logprobs, zeros(self.topk_logprobs)]),
        )
