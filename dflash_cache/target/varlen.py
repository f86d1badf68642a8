"""Run a Hugging Face target on packed rows: several samples concatenated in one sequence, each
seeing only itself.

Every layer must respect the boundaries given as cumulative sequence lengths (`cu_seqlens`):
- attention, full or over a sliding window, goes through `varlen_attention`, registered as the
  attention implementation `packed_rows` (flash attention's variable-length kernel on CUDA, one
  causal SDPA per sample elsewhere). Called without sequence lengths it is plain causal SDPA, so a
  target loaded with it runs padded batches exactly as with `sdpa`;
- rotary embeddings restart at each sample through `position_ids`;
- the linear-attention layers of hybrid `qwen3_5` targets (their short causal convolution and the
  gated delta rule) take the sequence lengths through flash-linear-attention's kernels, or run one
  sample at a time through the reference torch code when it is not installed or on the CPU.

target/families.py says which targets run packed; `packed_kernels` is the scope in which the
linear-attention functions of the qwen3_5 families (dense and mixture-of-experts) respect the boundaries.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from dflash_cache.target.families import linear_attention_module

ATTENTION = "packed_rows"  # no "flash" in the name: transformers takes such names for flash-attention kernels
# The hybrid family whose modules target/fused.py swaps.
HYBRID_PACKABLE = ("qwen3_5", "qwen3_5_text")
QWEN3_5_MODULE = "transformers.models.qwen3_5.modeling_qwen3_5"


def varlen_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling=None,
    cu_seq_lens_q=None,
    max_length_q=None,
    cu_seq_lens_cpu=None,
    sliding_window=None,
    **kwargs,
):
    """query [1, H, T, D], key/value [1, Hkv, T, D] -> ([1, T, H, D], None), causal per sample; a
    sliding-window layer's token sees itself and the `sliding_window` - 1 tokens before it, as in
    transformers' masks."""
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if attention_mask is not None or query.shape[0] != 1:
        raise ValueError("packed attention takes one row and no attention mask")
    if query.is_cuda:
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
        return _flash_varlen(q, k, v, cu_seq_lens_q, int(max_length_q), scaling, sliding_window).unsqueeze(0), None
    # Four-dimensional slices: SDPA takes its fused CPU kernel for these (three-dimensional ones fell
    # back to the unfused math, several times slower).
    bounds = cu_seq_lens_cpu.tolist()
    out = torch.cat(
        [
            F.scaled_dot_product_attention(
                query[:, :, s:e],
                key[:, :, s:e],
                value[:, :, s:e],
                attn_mask=None if sliding_window is None else _window_mask(e - s, sliding_window, query.device),
                is_causal=sliding_window is None,
                scale=scaling,
                enable_gqa=key.shape[1] != query.shape[1],
            )
            for s, e in zip(bounds, bounds[1:])
        ],
        dim=2,
    )
    return out.transpose(1, 2), None


def _window_mask(length: int, window: int, device) -> torch.Tensor:
    """[length, length] bool: query i sees keys i - window + 1 .. i."""
    offset = torch.arange(length, device=device)[:, None] - torch.arange(length, device=device)[None, :]
    return (offset >= 0) & (offset < window)


def _flash_varlen(q, k, v, cu_seqlens: torch.Tensor, max_len: int, scaling, window: int | None) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    params = varlen_params()
    # torch 2.11+ takes flash attention's (left, right) window; 2.10 only is_causal (no sliding windows then).
    left = -1 if window is None else window - 1
    extra = {"window_size": (left, 0)} if "window_size" in params else {"is_causal": True}
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale=scaling, **extra)


@lru_cache(maxsize=1)
def varlen_params() -> tuple[str, ...]:
    from torch.nn.attention.varlen import varlen_attn

    return tuple(inspect.signature(varlen_attn).parameters)


AttentionInterface.register(ATTENTION, varlen_attention)


@lru_cache(maxsize=1)
def linear_attention_kernels():
    """flash-linear-attention's (causal_conv1d, chunk_gated_delta_rule), or None when not installed."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # noqa: BLE001 - not installed, or no usable Triton on this machine
        return None
    return causal_conv1d, chunk_gated_delta_rule


def _spans(cu_seqlens_cpu: torch.Tensor) -> list[tuple[int, int]]:
    bounds = cu_seqlens_cpu.tolist()
    return list(zip(bounds, bounds[1:]))


def _rule_options(kwargs: dict) -> dict:
    """The gated delta rule's own options among the model's keyword arguments."""
    return {k: kwargs[k] for k in ("initial_state", "output_final_state", "use_qk_l2norm_in_kernel") if k in kwargs}


@contextmanager
def packed_kernels(model: torch.nn.Module) -> Iterator[None]:
    """While active, the linear-attention layers of a qwen3_5 or qwen3_5_moe `model` respect packed
    boundaries (passed to the forward as `cu_seq_lens_q` and `cu_seq_lens_cpu`); other models are untouched."""
    config = model.config.get_text_config()
    if "linear_attention" not in (getattr(config, "layer_types", None) or []):
        yield
        return
    module = linear_attention_module(config)
    conv, rule = module.causal_conv1d_fn, module.torch_chunk_gated_delta_rule
    module.causal_conv1d_fn, module.torch_chunk_gated_delta_rule = _packed_conv(conv), _packed_rule(rule)
    try:
        yield
    finally:
        module.causal_conv1d_fn, module.torch_chunk_gated_delta_rule = conv, rule


# The reference torch code under transformers' kernel dispatch, for one sample at a time (the
# dispatch would send CPU tensors to flash-linear-attention where it is installed).
def _packed_conv(conv):
    torch_conv = getattr(conv, "__wrapped__", conv)

    def packed_conv(x, weight, bias=None, activation=None, cu_seq_lens_q=None, cu_seq_lens_cpu=None, **kwargs):
        # x: [1, D, T] (a transposed view of [1, T, D]); returns [1, D, T]
        if cu_seq_lens_q is None:
            return conv(x, weight, bias, activation=activation)
        fla = linear_attention_kernels()
        if fla is not None and x.is_cuda:
            y, _ = fla[0](
                x.transpose(1, 2),
                weight,
                bias,
                activation=activation,
                cu_seqlens=cu_seq_lens_q,
                cu_seqlens_cpu=cu_seq_lens_cpu,
            )
            return y.transpose(1, 2)
        return torch.cat(
            [torch_conv(x[..., s:e], weight, bias, activation=activation) for s, e in _spans(cu_seq_lens_cpu)], dim=-1
        )

    return packed_conv


def _packed_rule(rule):
    torch_rule = getattr(rule, "__wrapped__", rule)

    def packed_rule(query, key, value, g, beta, cu_seqlens=None, cu_seq_lens_cpu=None, **kwargs):
        # [1, T, H, D] inputs; cu_seqlens is the model's `cu_seq_lens_q`
        if cu_seqlens is None:
            return rule(query, key, value, g=g, beta=beta, **kwargs)
        fla = linear_attention_kernels()
        if fla is not None and query.is_cuda:
            return fla[1](
                query,
                key,
                value,
                g=g,
                beta=beta,
                cu_seqlens=cu_seqlens,
                cu_seqlens_cpu=cu_seq_lens_cpu,
                **_rule_options(kwargs),
            )
        outs = [
            torch_rule(
                query[:, s:e], key[:, s:e], value[:, s:e], g=g[:, s:e], beta=beta[:, s:e], **_rule_options(kwargs)
            )[0]
            for s, e in _spans(cu_seq_lens_cpu)
        ]
        return torch.cat(outs, dim=1), None

    return packed_rule
