"""Cross-entropy through the frozen LM head, a chunk of rows at a time.

Full logits for 512 blocks x 15 slots x a 248K vocabulary would take gigabytes; here each chunk's
logits live only inside the forward. Because the head is frozen, the gradient with respect to the
drafter's states, (softmax - onehot) * row_weight @ W, is computed in the same pass and kept for
backward: no logits are stored and none are recomputed. The per-chunk math (`chunk_terms`) is a
plain function of tensors, so that the eager drafter can run it as a compiled region; on a GPU its
per-row part is a Triton kernel (drafter/head_kernel.py), elsewhere `reference_terms`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

if torch.cuda.is_available():  # Triton comes with CUDA builds of torch only
    from dflash_cache.drafter.head_kernel import row_terms

LOGITS_PER_CHUNK = 1 << 28  # fp32 logits elements per chunk (1 GiB)


def chunk_terms(states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, row_weights: torch.Tensor,
                with_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk: (sum_r row_weights[r] * CE_r, argmax predictions [r], gradient wrt states [r, H] or None)."""
    if not states.is_cuda:
        return reference_terms(states, weight, labels, row_weights, with_grad)
    scale = row_weights.float()
    nll, predictions, grad = row_terms(states.to(weight.dtype) @ weight.T, labels, scale, with_grad)
    return (nll * scale).sum(), predictions, grad @ weight if with_grad else None


def reference_terms(states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, row_weights: torch.Tensor,
                    with_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """chunk_terms in plain torch."""
    logits = (states.to(weight.dtype) @ weight.T).float()
    label = labels[:, None]
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    scale = row_weights[:, None].float()
    loss = ((lse - logits.gather(1, label)) * scale).sum()
    predictions = logits.argmax(-1)
    if not with_grad:
        return loss, predictions, None
    probs = logits.sub_(lse).exp_()
    probs.scatter_add_(1, label, torch.full_like(label, -1, dtype=probs.dtype))
    return loss, predictions, probs.mul_(scale).to(weight.dtype) @ weight


class WithGradient(torch.autograd.Function):
    """`loss` as a function of `states` whose gradient, `grad`, was computed ahead."""

    @staticmethod
    def forward(ctx, states: torch.Tensor, loss: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(grad)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return (grad * grad_loss).to(grad.dtype), None, None


def chunk_sizes(rows: int, chunk_rows: int, tile: int = 128, least: int = 16) -> list[int]:
    """Rows per chunk: see head_cross_entropy."""
    chunk = chunk_rows // tile * tile if chunk_rows >= tile else chunk_rows
    sizes = [chunk] * (rows // chunk)
    tail = rows - chunk * len(sizes)
    if tail and tail < least and sizes:
        sizes[-1] += tail
    elif tail:
        sizes.append(tail)
    return sizes


def head_cross_entropy(
    states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, row_weights: torch.Tensor,
    chunk_rows: int | None = None, terms: Callable = chunk_terms,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted CE sum over rows, argmax predictions) for states [R, H] through the head weight [V, H].

    Chunks are a whole number of 128-row tiles (the head's matmuls run best so), of at most
    `chunk_rows` rows; a remainder of fewer than 16 rows joins the last chunk, so that a region
    compiled for dynamic shapes never sees a chunk of one row, a size it would specialise on."""
    rows = states.shape[0]
    if rows == 0:
        return states.sum(dtype=torch.float32) * 0, labels.new_zeros(0)
    sizes = chunk_sizes(rows, chunk_rows or max(1, LOGITS_PER_CHUNK // weight.shape[0]))
    with_grad = states.requires_grad and torch.is_grad_enabled()
    with torch.no_grad():
        parts = [terms(s, weight.detach(), y, w, with_grad) for s, y, w in
                 zip(states.detach().split(sizes), labels.split(sizes), row_weights.split(sizes))]
    loss = torch.stack([part[0] for part in parts]).sum()
    predictions = torch.cat([part[1] for part in parts])
    if with_grad:
        loss = WithGradient.apply(states, loss, torch.cat([part[2] for part in parts]))
    return loss, predictions
