"""Flex attention with attention sinks (gpt-oss), renormalised for the sinks in fp32.

A sink is one more logit per head in each query's softmax, with no value behind it: the output of
attention over the real keys is scaled by exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink),
where lse is the log-sum-exp of the real scores that flex attention returns in fp32. transformers'
own flex path rounds lse to the model's dtype (bf16: 8 significant bits) before that step, and the
scale with it. Registered with transformers' attention and mask interfaces, so the model builds the
block mask that flex attention takes.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import AuxRequest, flex_attention
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import flex_attention_mask

ATTENTION = "sinks_flex"

# Inductor lowers flex attention over fewer than 128 query tokens to its decoding kernel, which sizes
# a query block as those tokens times the query heads per key head and has no configuration left once
# that passes 128 (a padded batch of short gpt-oss samples, 8 query heads a key head: NoValidChoicesError);
# the main kernel takes any length.
KERNEL_OPTIONS = {"BACKEND": "TRITON"}


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention)


def sinks_flex_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    scaling: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [B, Hq, T, D], key and value [B, Hkv, S, D], attention_mask a BlockMask; returns [B, T, Hq, D].
    Compiled on a GPU; on the CPU flex attention runs uncompiled (inductor's CPU kernel returns no lse)."""
    on_gpu = query.device.type == "cuda"
    out, aux = (_compiled_flex() if on_gpu else flex_attention)(
        query,
        key,
        value,
        block_mask=attention_mask,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
        kernel_options=KERNEL_OPTIONS if on_gpu else None,
        return_aux=AuxRequest(lse=True),
    )
    if s_aux is not None:
        out = out * torch.sigmoid(aux.lse - s_aux.float()[None, :, None])[..., None]
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, sinks_flex_attention)
AttentionMaskInterface.register(ATTENTION, flex_attention_mask)
