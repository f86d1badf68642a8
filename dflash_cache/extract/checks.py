"""Sanity checks on captured hidden states before a sample may be committed."""

from __future__ import annotations

import torch


def check_sample(hidden: torch.Tensor, layer_ids: list[int]) -> str | None:
    """hidden: one sample's [T, L*H] capture. Returns what is wrong with it, or None.

    All-zero layers are the known symptom of a hook that captured the wrong thing on hybrid models.
    """
    per_layer = hidden.view(hidden.shape[0], len(layer_ids), -1)
    nonfinite = (~torch.isfinite(per_layer)).any(dim=2).sum(dim=0)  # [L] tokens with a NaN/Inf
    zero = (per_layer == 0).all(dim=2).all(dim=0)  # [L]
    flags = torch.stack([nonfinite, zero.long()]).tolist()  # one device sync
    for layer, bad_tokens, all_zero in zip(layer_ids, *flags):
        if bad_tokens:
            return f"layer {layer} has NaN/Inf values at {bad_tokens} of {hidden.shape[0]} tokens"
        if all_zero:
            return f"layer {layer} is all zeros"
    return None
