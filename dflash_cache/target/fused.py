"""Fused kernels for the packed forward of a hybrid qwen3_5 target on CUDA (flash-linear-attention's).

On the 64-layer Qwen3.6-27B shape a quarter of HF's packed forward runs outside the matmuls
(a profile of `benchmarks/extract.py --profile DIR`): every RMSNorm is five kernels
with fp32 copies of the whole activation, SwiGLU two, the gated RMSNorm of the linear-attention
output about ten, and the query and key heads are copied out to the value heads' count before the
gated delta rule. While `fused_kernels` is active these modules run as one kernel each, and the
gated delta rule reads the grouped heads in place (fla's grouped value attention maps value head i
to key head i // (value heads / key heads), as `repeat_interleave` does).

The results are HF's up to bf16 rounding (one rounding where HF rounds two or three times); tests
compare packed rows against each sample run alone through HF's own modules.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

import torch
import torch.nn.functional as F

from dflash_cache.target.varlen import HYBRID_PACKABLE, QWEN3_5_MODULE, linear_attention_kernels


@lru_cache(maxsize=1)
def _fla():
    """fla's norm and SwiGLU kernels, or None when it is not installed or has no usable Triton here
    (its convolution and delta rule come from varlen.linear_attention_kernels)."""
    try:
        from fla.modules.activations import swiglu
        from fla.modules.norm.fused_norm_gate import rms_norm_gated
        from fla.modules.norm.layernorm import rms_norm
    except Exception:  # noqa: BLE001
        return None
    return {"swiglu": swiglu, "norm_gated": rms_norm_gated, "norm": rms_norm}


def fusable(model: torch.nn.Module) -> bool:
    """True for a qwen3_5 text model on CUDA where flash-linear-attention is installed."""
    config = model.config.get_text_config()
    hybrid = "linear_attention" in (getattr(config, "layer_types", None) or [])
    return (
        hybrid
        and config.model_type in HYBRID_PACKABLE
        and model.device.type == "cuda"
        and _fla() is not None
        and linear_attention_kernels() is not None
    )


def _zero_centered_rms_norm(self, x: torch.Tensor) -> torch.Tensor:
    # Qwen3_5RMSNorm scales by 1 + weight, in fp32.
    return _fla()["norm"](x, 1.0 + self.weight.float(), None, eps=self.eps)


def _gated_rms_norm(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return _fla()["norm_gated"](x, gate, self.weight, None, activation="swish", eps=self.variance_epsilon)


def _swiglu_mlp(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(_fla()["swiglu"](self.gate_proj(x), self.up_proj(x)))


def _packed_gated_delta_net(
    self,
    hidden_states: torch.Tensor,
    cache_params=None,
    attention_mask=None,
    cu_seq_lens_q=None,
    cu_seq_lens_cpu=None,
    **kwargs,
) -> torch.Tensor:
    """Qwen3_5GatedDeltaNet.forward for one packed row [1, T, hidden], no cache."""
    if cu_seq_lens_q is None or cache_params is not None or attention_mask is not None:
        raise ValueError("the fused linear-attention layer runs packed rows only (cu_seq_lens_q, no cache, no mask)")
    conv, rule = linear_attention_kernels()
    batch, seq, _ = hidden_states.shape
    bounds = dict(cu_seqlens=cu_seq_lens_q, cu_seqlens_cpu=cu_seq_lens_cpu)
    mixed_qkv, _ = conv(
        self.in_proj_qkv(hidden_states),
        self.conv1d.weight.squeeze(1),
        self.conv1d.bias,
        activation=self.activation,
        **bounds,
    )
    query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    query = query.reshape(batch, seq, -1, self.head_k_dim)
    key = key.reshape(batch, seq, -1, self.head_k_dim)
    value = value.reshape(batch, seq, -1, self.head_v_dim)
    beta = self.in_proj_b(hidden_states).sigmoid()
    g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(hidden_states).float() + self.dt_bias)
    out, _ = rule(query, key, value, g=g, beta=beta, use_qk_l2norm_in_kernel=True, **bounds)
    z = self.in_proj_z(hidden_states)
    out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(out.reshape(batch, seq, -1))


@contextmanager
def fused_kernels(model: torch.nn.Module) -> Iterator[None]:
    """While active, a `fusable` model's norms, SwiGLU and linear-attention layers run fla's fused
    kernels (its linear-attention layers then take packed rows only); other models are untouched."""
    if not fusable(model):
        yield
        return
    module = importlib.import_module(QWEN3_5_MODULE)
    swaps = {
        module.Qwen3_5RMSNorm: _zero_centered_rms_norm,
        module.Qwen3_5RMSNormGated: _gated_rms_norm,
        module.Qwen3_5MLP: _swiglu_mlp,
        module.Qwen3_5GatedDeltaNet: _packed_gated_delta_net,
    }
    originals = {cls: cls.forward for cls in swaps}
    for cls, forward in swaps.items():
        cls.forward = forward
    try:
        yield
    finally:
        for cls, forward in originals.items():
            cls.forward = forward
