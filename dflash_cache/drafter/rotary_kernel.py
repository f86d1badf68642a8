"""Each attention head's RMSNorm, its rotary embedding and flex-attention's layout in one pass (Triton).

    x [T, H * D] (a projection's output) -> out [1, Hkv, T * G, D], G = H / Hkv:
    out[0, h // G, t * G + h % G] = rotate(RMSNorm(x[t, h]) * weight, angles of position t)

the query heads of a key head packed query by query, as drafter/attention.py `attend` takes them
(G = 1 for keys). Inductor's code for the same chain (norm, rotary, the transposes into flex-attention's
layout, and their backward) ran the 27B drafter's four such kernels a layer well below the GPU's memory
bandwidth; this pass reads x once and writes the layout once, computing sin and cos on the fly, and
is faster side by side (BENCHMARKS.md, "Drafter step"). The backward
recomputes the rotation from the positions and the norm from x and the saved reciprocal RMS.
`norm_rotate_pack` is a torch custom op with its autograd, so the compiled drafter and the eager regions
trace it as one call; model.py's torch code for the same chain, what the CPU and the dense reference
run, is the reference it is tested against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton
from triton.language.extra import libdevice

# Tokens a program (one key head and its query heads each) and warps: the fastest of the five settings
# timed side by side (16-64 tokens, 4-8 warps).
BLOCK_T = 32
FORWARD_WARPS, BACKWARD_WARPS = 4, 8


@triton.jit
def _tiles(positions, inv_freq, weight, tokens, HALF: tl.constexpr, BLOCK_T: tl.constexpr):
    """This program's rows (int64) and which exist, the half-head columns, cos and sin [BLOCK_T, HALF] of the
    rows' positions (libdevice's, accurate for large angles) and the norm's weight by halves [1, HALF]."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    keep = rows < tokens
    cols = tl.arange(0, HALF)
    position = tl.load(positions + rows, mask=keep, other=0).to(tl.float32)
    angle = position[:, None] * tl.load(inv_freq + cols).to(tl.float32)[None, :]
    w1 = tl.load(weight + cols).to(tl.float32)[None, :]
    w2 = tl.load(weight + HALF + cols).to(tl.float32)[None, :]
    return rows.to(tl.int64), keep, cols, libdevice.cos(angle), libdevice.sin(angle), w1, w2


@triton.jit(do_not_specialize=["tokens"])
def _forward(
    x,
    weight,
    positions,
    inv_freq,
    out,
    rstd,
    tokens,
    eps,
    GROUP: tl.constexpr,
    KEY_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """One block of tokens, one key head and its GROUP query heads (the angles computed once for them)."""
    key_head = tl.program_id(1)
    rows64, keep, cols, cos, sin, w1, w2 = _tiles(positions, inv_freq, weight, tokens, HALF, BLOCK_T)
    for g in tl.static_range(GROUP):
        head = key_head * GROUP + g
        src = x + rows64[:, None] * (KEY_HEADS * GROUP * 2 * HALF) + head * 2 * HALF + cols[None, :]
        x1 = tl.load(src, mask=keep[:, None], other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=keep[:, None], other=0.0).to(tl.float32)
        r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)
        n1, n2 = x1 * r[:, None] * w1, x2 * r[:, None] * w2
        dst = out + (key_head * tokens + rows64[:, None]) * (GROUP * 2 * HALF) + g * 2 * HALF + cols[None, :]
        tl.store(dst, (n1 * cos - n2 * sin).to(out.dtype.element_ty), mask=keep[:, None])
        tl.store(dst + HALF, (n2 * cos + n1 * sin).to(out.dtype.element_ty), mask=keep[:, None])
        tl.store(rstd + rows64 * (KEY_HEADS * GROUP) + head, r, mask=keep)


@triton.jit(do_not_specialize=["tokens"])
def _backward(
    grad_out,
    x,
    weight,
    positions,
    inv_freq,
    rstd,
    grad_x,
    weight_parts,
    tokens,
    GROUP: tl.constexpr,
    KEY_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    key_head = tl.program_id(1)
    rows64, keep, cols, cos, sin, w1, w2 = _tiles(positions, inv_freq, weight, tokens, HALF, BLOCK_T)
    part1 = tl.zeros((HALF,), tl.float32)
    part2 = tl.zeros((HALF,), tl.float32)
    for g in tl.static_range(GROUP):
        head = key_head * GROUP + g
        at = grad_out + (key_head * tokens + rows64[:, None]) * (GROUP * 2 * HALF) + g * 2 * HALF + cols[None, :]
        dy1 = tl.load(at, mask=keep[:, None], other=0.0).to(tl.float32)
        dy2 = tl.load(at + HALF, mask=keep[:, None], other=0.0).to(tl.float32)
        dn1 = dy1 * cos + dy2 * sin  # the rotation's transpose
        dn2 = dy2 * cos - dy1 * sin
        src = rows64[:, None] * (KEY_HEADS * GROUP * 2 * HALF) + head * 2 * HALF + cols[None, :]
        r = tl.load(rstd + rows64 * (KEY_HEADS * GROUP) + head, mask=keep, other=0.0)[:, None]
        xh1 = tl.load(x + src, mask=keep[:, None], other=0.0).to(tl.float32) * r
        xh2 = tl.load(x + src + HALF, mask=keep[:, None], other=0.0).to(tl.float32) * r
        part1 += tl.sum(dn1 * xh1, 0)
        part2 += tl.sum(dn2 * xh2, 0)
        g1, g2 = dn1 * w1, dn2 * w2
        mean = (tl.sum(g1 * xh1, 1) + tl.sum(g2 * xh2, 1))[:, None] / (2 * HALF)
        tl.store(grad_x + src, (r * (g1 - xh1 * mean)).to(grad_x.dtype.element_ty), mask=keep[:, None])
        tl.store(grad_x + src + HALF, (r * (g2 - xh2 * mean)).to(grad_x.dtype.element_ty), mask=keep[:, None])
    part = weight_parts + (tl.program_id(0) * KEY_HEADS + key_head) * 2 * HALF + cols
    tl.store(part, part1)
    tl.store(part + HALF, part2)


@triton_op("dflash_cache::norm_rotate_pack", mutates_args=())
def norm_rotate_pack(
    x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, key_heads: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H * D] contiguous, weight [D], positions [T], inv_freq [D / 2] fp32 -> (out [1, key_heads, T * G, D]
    in x's dtype, reciprocal RMS [T, H] fp32)."""
    x = x.contiguous()  # the kernel indexes rows of H * D; a no-op for a projection's output
    tokens, half = x.shape[0], inv_freq.shape[0]
    heads = x.shape[1] // (2 * half)
    group = heads // key_heads
    out = x.new_empty((1, key_heads, tokens * group, 2 * half))
    rstd = torch.empty((tokens, heads), dtype=torch.float32, device=x.device)
    wrap_triton(_forward)[(triton.cdiv(tokens, BLOCK_T), key_heads)](
        x,
        weight,
        positions,
        inv_freq,
        out,
        rstd,
        tokens,
        eps,
        GROUP=group,
        KEY_HEADS=key_heads,
        HALF=half,
        BLOCK_T=BLOCK_T,
        num_warps=FORWARD_WARPS,
    )
    return out, rstd


@triton_op("dflash_cache::norm_rotate_pack_backward", mutates_args=())
def norm_rotate_pack_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad of x [T, H * D], grad of weight [D] in its dtype) from grad_out [1, Hkv, T * G, D] contiguous."""
    x = x.contiguous()
    tokens, heads = rstd.shape
    half, key_heads = inv_freq.shape[0], grad_out.shape[1]
    blocks = triton.cdiv(tokens, BLOCK_T)
    grad_x = torch.empty_like(x)
    weight_parts = torch.empty((blocks * key_heads, 2 * half), dtype=torch.float32, device=x.device)
    wrap_triton(_backward)[(blocks, key_heads)](
        grad_out,
        x,
        weight,
        positions,
        inv_freq,
        rstd,
        grad_x,
        weight_parts,
        tokens,
        GROUP=heads // key_heads,
        KEY_HEADS=key_heads,
        HALF=half,
        BLOCK_T=BLOCK_T,
        num_warps=BACKWARD_WARPS,
    )
    return grad_x, weight_parts.sum(0).to(weight.dtype)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, positions, inv_freq, _, _ = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, weight, positions, inv_freq, output[1])


def _backward_rule(ctx, grad_out: torch.Tensor, grad_rstd: torch.Tensor | None):
    x, weight, positions, inv_freq, rstd = ctx.saved_tensors
    grad_x, grad_weight = norm_rotate_pack_backward(grad_out.contiguous(), x, weight, positions, inv_freq, rstd)
    return grad_x, grad_weight, None, None, None, None


norm_rotate_pack.register_autograd(_backward_rule, setup_context=_setup_context)
