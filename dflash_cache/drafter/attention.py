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

# On the CPU, flex-attention runs unfused (compiling its CPU kernel takes most of a minute and buys
# nothing at test sizes); the unfused path warns on every first use.
warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask | torch.Tensor) -> torch.Tensor:
    """q [1, Hq, Q, D]; k, v [1, Hkv, KV, D]; mask a BlockMask or a dense [Q, KV] bool -> [1, Hq, Q, D]."""
    if q.shape[2] == 0:  # a batch without blocks; flex-attention cannot run on no queries
        mask = torch.zeros(0, k.shape[2], dtype=torch.bool, device=q.device)
    if isinstance(mask, torch.Tensor):
        return reference_attention(q, k, v, mask)
    # Inside a compiled drafter torch.compile captures flex_attention itself.
    kernel = compiled_flex_attention if q.device.type == "cuda" and not torch.compiler.is_compiling() else flex_attention
    return kernel(q, k, v, block_mask=mask, enable_gqa=True)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
