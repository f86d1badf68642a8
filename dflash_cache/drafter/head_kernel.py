"""The LM-head loss's per-row math on a GPU in two passes over the logits (Triton).

For each row of a chunk of logits [R, V]: the log-sum-exp, the argmax and the label's logit in one
online pass (running maximum, rescaled sum of exponentials) split over SEGMENTS programs a row and
combined by a small second kernel, then, for the gradient, (softmax - onehot) * row_weight written in a
second pass. With one program a row, a 1024-row chunk filled the GPU poorly; 8 segments were the fastest measured (16
and 32 segments, or 8 warps, no better). Inductor's code for the same math in torch
(head_loss.reference_terms) was slower and took more memory in the compiled 27B drafter step
(benchmarks/head_loss.py, BENCHMARKS.md "Drafter step"). `row_terms`
is a torch custom op, so the compiled drafter and the eager regions trace it as one call;
head_loss.reference_terms, what the CPU runs, is the reference it is tested against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

BLOCK = 4096  # logits per loop iteration: a 248K vocabulary is 61 iterations of a row
SEGMENTS = 8  # programs a row's statistics are split over (a power of two)
WARPS = 4  # of each segment's program


@triton.jit
def _segment_stats(
    logits, stride, vocab, per_segment, seg_max, seg_sum, seg_index, SEGMENTS: tl.constexpr, BLOCK: tl.constexpr
):
    """One segment of a row: its maximum, the sum of exp(logit - maximum) and the first index of the maximum."""
    row = tl.program_id(0).to(tl.int64)
    segment = tl.program_id(1)
    base = logits + row * stride
    running_max = tl.full((), float("-inf"), tl.float32)
    running_sum = tl.zeros((), tl.float32)
    best_index = tl.zeros((), tl.int64)
    begin = segment * per_segment
    for start in range(begin, tl.minimum(begin + per_segment, vocab), BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        block_max = tl.max(x, 0)
        block_index = start + tl.argmax(x, 0, tie_break_left=True).to(tl.int64)
        # strictly greater: on a tie the earlier block keeps it, so ties go to the first index (torch.argmax's)
        best_index = tl.where(block_max > running_max, block_index, best_index)
        new_max = tl.maximum(running_max, block_max)
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), 0)
        running_max = new_max
    at = row * SEGMENTS + segment
    tl.store(seg_max + at, running_max)
    tl.store(seg_sum + at, running_sum)
    tl.store(seg_index + at, best_index)


@triton.jit
def _row_stats(logits, labels, stride, seg_max, seg_sum, seg_index, nll, argmax, SEGMENTS: tl.constexpr):
    """A row's segments combined: its log-sum-exp, hence the label's negative log-likelihood, and argmax."""
    row = tl.program_id(0).to(tl.int64)
    at = row * SEGMENTS + tl.arange(0, SEGMENTS)
    maxima = tl.load(seg_max + at)
    row_max = tl.max(maxima, 0)
    # segments are in vocabulary order: the first segment holding the maximum holds its first index
    first = tl.argmax(maxima, 0, tie_break_left=True)
    best_index = tl.sum(tl.where(tl.arange(0, SEGMENTS) == first, tl.load(seg_index + at), 0), 0)
    total = tl.sum(tl.load(seg_sum + at) * tl.exp(maxima - row_max), 0)
    lse = row_max + tl.log(total)
    target = tl.load(logits + row * stride + tl.load(labels + row)).to(tl.float32)
    tl.store(nll + row, lse - target)
    tl.store(argmax + row, best_index)


@triton.jit
def _row_gradient(logits, labels, scales, nll, stride, vocab, grad, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < vocab
    label = tl.load(labels + row)
    # lse = nll + target logit
    lse = tl.load(nll + row) + tl.load(logits + row * stride + label).to(tl.float32)
    x = tl.load(logits + row * stride + cols, mask=keep, other=0.0).to(tl.float32)
    p = tl.exp(x - lse) - tl.where(cols == label, 1.0, 0.0)
    tl.store(grad + row * vocab + cols, (p * tl.load(scales + row)).to(grad.dtype.element_ty), mask=keep)


@triton_op("dflash_cache::head_row_terms", mutates_args=())
def row_terms(
    logits: torch.Tensor, labels: torch.Tensor, scales: torch.Tensor, with_grad: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [R, V] (rows contiguous), labels [R], scales [R] fp32 -> (nll [R] fp32, argmax [R] int64,
    (softmax - onehot) * scales [R, V] in the logits' dtype; [0, V] when not with_grad)."""
    rows, vocab = logits.shape
    nll = torch.empty(rows, dtype=torch.float32, device=logits.device)
    argmax = torch.empty(rows, dtype=torch.int64, device=logits.device)
    grad = torch.empty((rows if with_grad else 0, vocab), dtype=logits.dtype, device=logits.device)
    if rows == 0:
        return nll, argmax, grad
    per_segment = triton.cdiv(triton.cdiv(vocab, SEGMENTS), BLOCK) * BLOCK
    seg_max, seg_sum = (torch.empty(rows, SEGMENTS, dtype=torch.float32, device=logits.device) for _ in range(2))
    seg_index = torch.empty(rows, SEGMENTS, dtype=torch.int64, device=logits.device)
    wrap_triton(_segment_stats)[(rows, SEGMENTS)](
        logits,
        logits.stride(0),
        vocab,
        per_segment,
        seg_max,
        seg_sum,
        seg_index,
        SEGMENTS=SEGMENTS,
        BLOCK=BLOCK,
        num_warps=WARPS,
    )
    wrap_triton(_row_stats)[(rows,)](
        logits, labels, logits.stride(0), seg_max, seg_sum, seg_index, nll, argmax, SEGMENTS=SEGMENTS
    )
    if with_grad:
        wrap_triton(_row_gradient)[(rows, triton.cdiv(vocab, BLOCK))](
            logits, labels, scales, nll, logits.stride(0), vocab, grad, BLOCK=BLOCK
        )
    return nll, argmax, grad
