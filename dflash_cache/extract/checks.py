"""Sanity checks on captured hidden states before a sample may be committed.

Split in two so the thread driving the GPU never waits for a result: `layer_health` runs on the
device over a whole batch and its small result travels to the host with the hidden states;
`describe_problem` reads it there, on a compression thread.
"""

from __future__ import annotations

import numpy as np
import torch


def layer_health(hidden: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor, num_layers: int) -> torch.Tensor:
    """hidden: a forward's capture [B, T, L*H]; sample i holds the flattened positions offsets[i] to
    offsets[i] + lengths[i] (both [n] int64 on hidden's device).

    Returns int32 [n, 2, L] on hidden's device: per sample and layer, the number of its tokens with
    a NaN/Inf value, and the number of its tokens with a nonzero value. Other positions are ignored.
    """
    batch, seq, _ = hidden.shape
    # One reduction over each token's layer slice, no full-size temporaries: NaN propagates into
    # both extremes, an Inf shows in one of them, and an all-zero slice has both at 0.
    low, high = torch.aminmax(hidden.view(batch * seq, num_layers, -1), dim=-1)  # [B*T, L]
    nonfinite = ~(torch.isfinite(low) & torch.isfinite(high))
    nonzero = (low != 0) | (high != 0)
    flags = torch.stack([nonfinite, nonzero], dim=1).to(torch.int32)  # [B*T, 2, L]
    # Per-sample sums as differences of a running sum: one pass, whatever the number of samples.
    running = torch.cat([torch.zeros_like(flags[:1]), flags.cumsum(0, dtype=torch.int32)])
    return running[offsets + lengths] - running[offsets]


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
