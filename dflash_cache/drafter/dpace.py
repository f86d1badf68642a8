"""D-PACE's per-slot loss weights (dynamic position-aware cross-entropy, arXiv:2605.18810).

A block's draft is accepted up to its first miss, so its expected accepted length is
sum_m prod_{i<=m} q_i, where q_i is the chance that slot i is right; the drafter's probability of
the slot's label, exp(-CE_i), stands in for it. The derivative of that length with respect to
log q_k is sum_{m>=k} prod_{i<=m} q_i: raising slot k's probability pays off through every later
slot it lets through. D-PACE weighs slot k's cross-entropy by exactly that, with each q_i first
pulled toward 1 as alpha + (1 - alpha) * q_i, so that the products, and with them the weights of
late slots, never collapse to nothing while the drafter is still poor (alpha = 1 gives every
slot k the weight of the number of counted slots from k on; alpha must be in (0, 1]). The
weights are constants of the step (no gradient flows through them), so the loss only reassigns
credit among slots, following the drafter's current confidence rather than a fixed decay.

Slots that do not count (their token is not loss-masked) are skipped: a factor of 1 in the
products, no term of their own in the sums and no weight. This is the definition speculators
0.9.0, SpecForge and NVIDIA Model-Optimizer use, alpha 0.5 being their default; the
three differ only in what the weighted sum is divided by (counted slots, sequences, the sum of
the weights); here, as speculators does, by the number of counted slots.
"""

from __future__ import annotations

import torch


def dpace_weights(nll: torch.Tensor, counted: torch.Tensor, alpha: float) -> torch.Tensor:
    """[A, B-1] fp32 weights of slots 1..B-1 from their cross-entropies `nll` and counted masks [A, B-1]."""
    with torch.no_grad():
        smoothed = torch.where(counted, alpha + (1 - alpha) * torch.exp(-nll.float()), 1.0)
        reach = torch.cumprod(smoothed, dim=1) * counted
        return reach.flip(1).cumsum(1).flip(1) * counted
