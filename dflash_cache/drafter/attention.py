"""The attention kernels: flex-attention with a BlockMask, and a dense-mask reference."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from dflash_cache.drafter.regions import region


def compile_flex_attention(backend: str = "inductor"):
    """One kernel for every batch shape, for the drafter's calls outside a compiled region (the CPU
    tests audit its guards under aot_eager)."""
    return region(flex_attention, backend)


compiled_flex_attention = compile_flex_attention()

# Inductor's flex-attention options for every drafter call:
#  - the main kernel always, never the decoding kernel Inductor picks for fewer than 128 queries (it found
#    no configuration for fp32 in a dynamic-shape region, in a GPU test). Inductor still guards on
#    that count (docs/ARCHITECTURE.md, "Eager by default, compiled in regions");
#  - the backward's tile sizes that Inductor's autotuner chose on an H200 at the 27B drafter's shapes, for
#    both layer kinds: faster than its default per layer, side by side (benchmarks/flex_configs.py).
KERNEL_OPTIONS = {
    "FORCE_USE_FLEX_ATTENTION": True,
    "bwd_BLOCK_M1": 32,
    "bwd_BLOCK_N1": 64,
    "bwd_BLOCK_M2": 64,
    "bwd_BLOCK_N2": 32,
    "bwd_num_stages": 3,
    "bwd_num_warps": 4,
}

# On the CPU, flex-attention runs unfused (compiling its CPU kernel takes most of a minute and buys
# nothing at test sizes); the unfused path warns on every first use.
warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")


def pack_heads(t: torch.Tensor, key_heads: int) -> torch.Tensor:
    """[T, H, D] -> [1, key_heads, T * G, D], G = H / key_heads: each key head's G heads packed token by
    token, the layout `attend` takes (for keys and values G = 1: [1, key_heads, T, D], contiguous, which
    inductor's CPU flex kernel needs)."""
    tokens, heads, dim = t.shape
    group = heads // key_heads
    return t.view(tokens, key_heads, group, dim).permute(1, 0, 2, 3).reshape(1, key_heads, tokens * group, dim)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask | torch.Tensor, group: int
) -> torch.Tensor:
    """q [1, Hkv, Q * group, D], k, v [1, Hkv, KV, D] (pack_heads) -> [Q, Hkv * group, D]. `mask` is a dense
    [Q, KV] bool, or a BlockMask with `group` rows per query (masks.block_mask's `group`): each key head then
    attends once for its group of query heads."""
    _, key_heads, rows, dim = q.shape
    queries = rows // group
    if queries == 0:  # a batch without blocks; flex-attention cannot run on no queries
        mask = torch.zeros(0, k.shape[2], dtype=torch.bool, device=q.device)
    if isinstance(mask, torch.Tensor):
        per_head = q[0].view(key_heads, queries, group, dim).transpose(1, 2)
        per_head = per_head.reshape(1, key_heads * group, queries, dim)
        return reference_attention(per_head, k, v, mask)[0].transpose(0, 1)
    # Inside a compiled drafter torch.compile captures flex_attention itself.
    kernel = (
        compiled_flex_attention if q.device.type == "cuda" and not torch.compiler.is_compiling() else flex_attention
    )
    out = kernel(q, k, v, block_mask=mask, kernel_options=KERNEL_OPTIONS)
    return out.view(key_heads, queries, group, dim).permute(1, 0, 2, 3).reshape(queries, key_heads * group, dim)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
