"""The DFlash training objective and its metrics.

Slot k (1..B-1) of the block at anchor a predicts the token at a+k: the target's own next token
`target_ids[a+k-1]` (labels="target") or the data's token `input_ids[a+k]` (labels="tokens"). Only
slots whose token is loss-masked count, weighted exp(-(k-1)/gamma): early slots matter most, since a
draft is accepted only up to its first miss. The loss is the weighted mean over counted slots.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dflash_cache.drafter.head_loss import chunk_terms, head_cross_entropy
from dflash_cache.drafter.inputs import DraftInputs
from dflash_cache.errors import DFlashCacheError

LABELS = ("target", "tokens")


@dataclass
class DrafterLoss:
    loss: torch.Tensor  # scalar
    correct: torch.Tensor  # [B-1] correct predictions per slot, counted slots only
    total: torch.Tensor  # [B-1] counted (loss-masked) slots per slot
    tau: torch.Tensor  # scalar: mean over blocks of 1 + leading correct slots
    num_blocks: torch.Tensor  # scalar: blocks with at least one counted slot

    @property
    def accuracy(self) -> torch.Tensor:
        return self.correct / self.total.clamp_min(1)


def slot_weights(block_size: int, gamma: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """[B-1] weight of slots 1..B-1: exp(-(k-1)/gamma)."""
    return torch.exp(-torch.arange(block_size - 1, device=device, dtype=torch.float32) / gamma)


def block_labels(inputs: DraftInputs, block_size: int, labels: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels [A, B-1], counted [A, B-1]) for slots 1..B-1 of every block."""
    if labels not in LABELS:
        raise DFlashCacheError(f"unknown labels {labels!r}; use one of {list(LABELS)}.")
    index = inputs.anchors[:, None] + torch.arange(1, block_size, device=inputs.anchors.device)
    wanted = inputs.target_ids[index - 1] if labels == "target" else inputs.input_ids[index]
    return wanted, inputs.loss_mask[index]


def acceptance(hits: torch.Tensor, counted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tau, number of blocks) from per-slot hits and counted masks [A, B-1].

    A block's accepted length is 1 (its real token) plus its leading run of counted, correct slots;
    an uncounted slot ends the run, as a miss would. Blocks with no counted slot are left out."""
    run = (hits & counted).long().cumprod(1).sum(1)
    valid = counted.any(1)
    num_blocks = valid.sum()
    tau = ((1 + run) * valid).sum() / num_blocks.clamp_min(1)
    return tau, num_blocks


def drafter_loss(
    states: torch.Tensor, lm_head: torch.Tensor, inputs: DraftInputs, gamma: float, labels: str = "target",
    terms: Callable = chunk_terms,
) -> DrafterLoss:
    """states [A, B, H]: the drafter's final hidden states of every block (slot 0 is not scored);
    `terms` the head loss's per-chunk math (a compiled region in the eager drafter)."""
    a, b, h = states.shape
    wanted, counted = block_labels(inputs, b, labels)
    weights = slot_weights(b, gamma, states.device)[None, :] * counted
    row_weights = (weights / weights.sum().clamp_min(1e-6)).reshape(-1)
    loss, predictions = head_cross_entropy(states[:, 1:].reshape(-1, h), lm_head, wanted.reshape(-1), row_weights,
                                           terms=terms)
    hits = predictions.view(a, b - 1) == wanted
    tau, num_blocks = acceptance(hits, counted)
    return DrafterLoss(
        loss=loss,
        correct=(hits & counted).sum(0),
        total=counted.sum(0),
        tau=tau,
        num_blocks=num_blocks,
    )
