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


def chunk_terms(
    states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    row_weights: torch.Tensor,
    with_grad: bool,
    label_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk: (cross-entropy of each row [r] fp32, argmax predictions [r], gradient of
    sum_r row_weights[r] * CE_r wrt states [r, H], or None).

    labels [r]: one token a row. labels [r, K] with label_probs [r, K] (summing to 1 a row): the
    cross-entropy against that distribution over K tokens; it runs in plain torch on every device,
    since the GPU kernel takes one label a row."""
    if not states.is_cuda or label_probs is not None:
        return reference_terms(states, weight, labels, row_weights, with_grad, label_probs)
    scale = row_weights.float()
    nll, predictions, grad = row_terms(states.to(weight.dtype) @ weight.T, labels, scale, with_grad)
    return nll, predictions, grad @ weight if with_grad else None


def reference_terms(
    states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    row_weights: torch.Tensor,
    with_grad: bool,
    label_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """chunk_terms in plain torch."""
    logits = (states.to(weight.dtype) @ weight.T).float()
    label = labels[:, None] if label_probs is None else labels
    probs = torch.ones_like(label, dtype=logits.dtype) if label_probs is None else label_probs.float()
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    nll = lse[:, 0] - (logits.gather(1, label) * probs).sum(1)
    predictions = logits.argmax(-1)
    if not with_grad:
        return nll, predictions, None
    softmax = logits.sub_(lse).exp_()
    softmax.scatter_add_(1, label, -probs)
    return nll, predictions, softmax.mul_(row_weights[:, None].float()).to(weight.dtype) @ weight


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
    states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    row_weights: torch.Tensor,
    chunk_rows: int | None = None,
    terms: Callable = chunk_terms,
    label_probs: torch.Tensor | None = None,
    reweight: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted CE sum over rows, argmax predictions) for states [R, H] through the head weight [V, H].

    labels [R], or [R, K] with label_probs [R, K]: see chunk_terms. `reweight`, given every row's
    cross-entropy [R] (fp32, no gradient), returns further row weights [R] that multiply `row_weights`:
    weights that depend on the loss itself are known only once every chunk has run, and since each
    row's gradient is linear in its weight, the chunks' gradients are scaled then rather than
    computed again.

    Chunks are a whole number of 128-row tiles (the head's matmuls run best so), of at most
    `chunk_rows` rows; a remainder of fewer than 16 rows joins the last chunk, so that a region
    compiled for dynamic shapes never sees a chunk of one row, a size it would specialise on."""
    rows = states.shape[0]
    if rows == 0:
        return states.sum(dtype=torch.float32) * 0, labels.new_zeros(0)
    sizes = chunk_sizes(rows, chunk_rows or max(1, LOGITS_PER_CHUNK // weight.shape[0]))
    with_grad = states.requires_grad and torch.is_grad_enabled()
    probs = [None] * len(sizes) if label_probs is None else label_probs.split(sizes)
    with torch.no_grad():
        parts = [
            terms(s, weight.detach(), y, w, with_grad, p)
            for s, y, w, p in zip(states.detach().split(sizes), labels.split(sizes), row_weights.split(sizes), probs)
        ]
        nll = torch.cat([part[0] for part in parts])
        scale = row_weights.float()
        grad = torch.cat([part[2] for part in parts]) if with_grad else None
        if reweight is not None:
            extra = reweight(nll).float()
            scale = scale * extra
            grad = None if grad is None else (grad * extra[:, None]).to(grad.dtype)
        loss = (nll * scale).sum()
    predictions = torch.cat([part[1] for part in parts])
    if with_grad:
        loss = WithGradient.apply(states, loss, grad)
    return loss, predictions
