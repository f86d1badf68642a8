"""Anchor sampling: where in each packed sequence the training blocks start."""

from __future__ import annotations

import torch

from dflash_cache.stream.batch import FeatureBatch


def anchor_candidates(batch: FeatureBatch, block_size: int) -> torch.Tensor:
    """[N] bool: positions whose block fits in their sequence and predicts a loss-masked token.

    A block at anchor a predicts tokens a+1 .. a+B-1, so it must end inside the sequence and one of
    those tokens must be loss-masked.
    """
    n = batch.num_tokens
    seq = batch.sequence_ids()
    lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).long()
    fits = batch.position_ids() + block_size <= lengths[seq]
    masked_so_far = torch.cumsum(batch.loss_mask.long(), 0)  # masked tokens in [0, i]
    index = torch.arange(n, device=seq.device)
    last = (index + block_size - 1).clamp(max=n - 1)
    return fits & (masked_so_far[last] - masked_so_far > 0)


def sample_anchors(
    batch: FeatureBatch,
    block_size: int,
    max_anchors: int,
    generator: torch.Generator | None = None,
    max_total: int | None = None,
) -> torch.Tensor:
    """Up to `max_anchors` anchors per sequence, drawn uniformly without replacement among the
    candidates, as sorted packed indices [A] int64. With `max_total`, a uniform subset of at most that
    many is kept (the compiled drafter's fixed anchor budget). Deterministic for a given generator
    state; the random draws are made on the generator's device."""
    n = batch.num_tokens
    device = batch.input_ids.device
    candidates = anchor_candidates(batch, block_size)
    seq = batch.sequence_ids()
    draw_device = generator.device if generator is not None else device
    keys = torch.rand(n, generator=generator, device=draw_device, dtype=torch.float64).to(device)
    # Sort by sequence, then candidates first, then by random key: the first `max_anchors` of each
    # sequence's run are its sample.
    order = torch.argsort(seq.double() * 4 + (~candidates).double() * 2 + keys)
    rank = torch.arange(n, device=device) - batch.cu_seqlens.long()[seq[order]]
    keep = candidates[order] & (rank < max_anchors)
    anchors = torch.sort(order[keep]).values
    if max_total is not None and anchors.numel() > max_total:
        pick = torch.randperm(anchors.numel(), generator=generator, device=draw_device)[:max_total].to(device)
        anchors = torch.sort(anchors[pick]).values
    return anchors
