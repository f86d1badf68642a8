"""The drafter's training objectives and their metrics.

Slot k (1..B-1) of the block at anchor a predicts the token at a+k: the target's own next token
`target_ids[a+k-1]` (labels="target") or the data's token `input_ids[a+k]` (labels="tokens"). Only
slots whose token is loss-masked count. The objective (`loss`) is one of:

- "dflash": DFlash's cross-entropy against those labels, slot k weighted exp(-(k-1)/gamma) (early
  slots matter most, since a draft is accepted only up to its first miss); the weighted mean over
  counted slots.
- "dpace": the same cross-entropy with D-PACE's weights (drafter/dpace.py) instead of the fixed decay.
- "topk": distillation toward the target's own distribution at a+k-1, as far as the cache keeps it:
  its top-K tokens (`extract --topk K`), their probabilities renormalised to sum to 1; the
  cross-entropy against that distribution, weighted by slot as "dflash" weighs it.

Whatever the objective, the metrics (accuracy, tau) compare the drafter's argmax with the labels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dflash_cache.choices import DPACE_ALPHA, LOSSES
from dflash_cache.drafter.dpace import dpace_weights
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


def block_topk(inputs: DraftInputs, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [A, B-1, K], probabilities [A, B-1, K]) of the target's top-K at a+k-1 for slots 1..B-1, the
    probabilities renormalised over the K kept tokens."""
    if inputs.topk_ids is None or inputs.topk_logprobs is None:
        raise DFlashCacheError(
            "--loss topk needs the target's top-K labels, which this cache lacks: extract it "
            "with --topk K (e.g. --topk 8), or train with --loss dflash or dpace"
        )
    index = inputs.anchors[:, None] + torch.arange(0, block_size - 1, device=inputs.anchors.device)
    return inputs.topk_ids[index], torch.softmax(inputs.topk_logprobs[index].float(), dim=-1)


def drafter_loss(
    states: torch.Tensor,
    lm_head: torch.Tensor,
    inputs: DraftInputs,
    gamma: float,
    labels: str = "target",
    terms: Callable = chunk_terms,
    loss: str = LOSSES[0],
    dpace_alpha: float = DPACE_ALPHA,
) -> DrafterLoss:
    """states [A, B, H]: the drafter's final hidden states of every block (slot 0 is not scored);
    `terms` the head loss's per-chunk math (a compiled region in the eager drafter); `loss` one of
    LOSSES (see the module's docstring), `dpace_alpha` D-PACE's smoothing."""
    if loss not in LOSSES:
        raise DFlashCacheError(f"unknown loss {loss!r}; use one of {list(LOSSES)}.")
    if loss == "topk" and labels != "target":
        raise DFlashCacheError("--loss topk distils the target's own distribution; it needs --labels target")
    a, b, h = states.shape
    wanted, counted = block_labels(inputs, b, labels)
    rows = states[:, 1:].reshape(-1, h)
    if loss == "dpace":
        # Normalised by the number of counted slots: the weights themselves carry the emphasis.
        row_weights = (counted / counted.sum().clamp_min(1)).reshape(-1)
        value, predictions = head_cross_entropy(
            rows,
            lm_head,
            wanted.reshape(-1),
            row_weights,
            terms=terms,
            reweight=lambda nll: dpace_weights(nll.view(a, b - 1), counted, dpace_alpha).reshape(-1),
        )
    else:
        weights = slot_weights(b, gamma, states.device)[None, :] * counted
        row_weights = (weights / weights.sum().clamp_min(1e-6)).reshape(-1)
        if loss == "topk":
            ids, probs = block_topk(inputs, b)
            value, predictions = head_cross_entropy(
                rows, lm_head, ids.flatten(0, 1), row_weights, terms=terms, label_probs=probs.flatten(0, 1)
            )
        else:
            value, predictions = head_cross_entropy(rows, lm_head, wanted.reshape(-1), row_weights, terms=terms)
    hits = predictions.view(a, b - 1) == wanted
    tau, num_blocks = acceptance(hits, counted)
    return DrafterLoss(
        loss=value,
        correct=(hits & counted).sum(0),
        total=counted.sum(0),
        tau=tau,
        num_blocks=num_blocks,
    )
