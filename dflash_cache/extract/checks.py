"""Sanity checks on captured hidden states before a sample may be committed.

Split in two so the thread driving the GPU never waits for a result: `layer_health` runs on the
device over a whole batch and its small result travels to the host with the hidden states;
`describe_problem` reads it there, on a compression thread.
"""

from __future__ import annotations

import numpy as np
import torch


def layer_health(hidden: torch.Tensor, lengths: torch.Tensor, num_layers: int) -> torch.Tensor:
    """hidden: a right-padded batch's capture [B, T, L*H]; lengths: [B] on hidden's device.

    Returns int32 [B, 2, L] on hidden's device: per sample and layer, the number of real tokens with
    a NaN/Inf value, and the number of real tokens with a nonzero value. Padding is ignored.
    """
    batch, seq, _ = hidden.shape
    # One reduction over each token's layer slice, no full-size temporaries: NaN propagates into
    # both extremes, an Inf shows in one of them, and an all-zero slice has both at 0.
    low, high = torch.aminmax(hidden.view(batch, seq, num_layers, -1), dim=-1)  # [B, T, L]
    real = (torch.arange(seq, device=hidden.device) < lengths[:, None])[..., None]  # [B, T, 1]
    nonfinite = ~(torch.isfinite(low) & torch.isfinite(high)) & real
    nonzero = ((low != 0) | (high != 0)) & real
    return torch.stack([nonfinite.sum(1), nonzero.sum(1)], dim=1).to(torch.int32)


def describe_problem(health: np.ndarray, layer_ids: list[int], num_tokens: int) -> str | None:
    """health: one sample's [2, L] from `layer_health`. Returns what is wrong with it, or None.

    All-zero layers are the known symptom of a hook that captured the wrong thing on hybrid models.
    """
    for layer, bad_tokens, nonzero_tokens in zip(layer_ids, health[0].tolist(), health[1].tolist()):
        if bad_tokens:
            return f"layer {layer} has NaN/Inf values at {bad_tokens} of {num_tokens} tokens"
        if not nonzero_tokens:
            return f"layer {layer} is all zeros"
    return None
