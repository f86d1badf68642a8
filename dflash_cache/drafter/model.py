"""The DFlash drafter: a few Qwen3-style decoder layers that draft a block of tokens at once.

Parameter names follow the reference (`dflash.model.DFlashDraftModel`), so a state dict exports as is.

    context = hidden_norm(fc(target hidden states of the chosen layers))        [N, H]
    block   = target embeddings of [token at anchor, mask, mask, ...]            [A*B, H]
    each layer: queries from the block; keys/values from the context (through the layer's own
                k/v projections) followed by the block's own; then the MLP
    states  = norm(block) -> the target's LM head
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from dflash_cache.choices import DPACE_ALPHA, LOSSES
from dflash_cache.drafter.attention import attend, pack_heads
from dflash_cache.drafter.config import DrafterConfig
from dflash_cache.drafter.head import TargetHead
from dflash_cache.drafter.head_loss import chunk_terms
from dflash_cache.drafter.inputs import DraftInputs
from dflash_cache.drafter.loss import DrafterLoss, drafter_loss
from dflash_cache.drafter.masks import BatchMasks, BlockLayout
from dflash_cache.drafter.regions import region
from dflash_cache.errors import DFlashCacheError

if torch.cuda.is_available():  # Triton comes with CUDA builds of torch only
    from dflash_cache.drafter.rotary_kernel import norm_rotate_pack


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # The outer cast keeps bf16 activations bf16 under autocast, where the weight is fp32.
        return (self.weight * x32.to(x.dtype)).to(x.dtype)


def rotary_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)


def rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated to `positions` [T] (cos and sin rounded to x's dtype)."""
    angles = positions.float()[:, None] * inv_freq.float()[None, :]
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def attention_heads(
    x: torch.Tensor, norm: RMSNorm, positions: torch.Tensor, inv_freq: torch.Tensor, key_heads: int, fused: bool
) -> torch.Tensor:
    """A projection [T, H * D] -> [1, key_heads, T * G, D] for `attend`: each head RMS-normed and rotated to
    its position. fused: one Triton pass (drafter/rotary_kernel.py); else this torch code, its reference."""
    if fused:
        return norm_rotate_pack(x, norm.weight, positions, inv_freq, key_heads, norm.eps)[0]
    heads = norm(x.unflatten(-1, (-1, 2 * inv_freq.shape[0])))
    return pack_heads(rotate(heads, positions, inv_freq), key_heads)


class Attention(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.head_dim = d
        self.key_heads = config.num_key_value_heads
        self.group = config.num_attention_heads // config.num_key_value_heads
        self.q_proj = nn.Linear(h, config.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, config.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, config.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(self, x, context, inv_freq, positions_q, positions_kv, mask) -> torch.Tensor:
        """x [Q, H] normed block states; context [N, H]; positions_q of the Q block tokens, positions_kv of
        the N context then Q block tokens; mask a BlockMask or dense [Q, N+Q] (the reference: torch code
        throughout)."""
        half = self.head_dim // 2  # the kernel's tiles take a power of two
        fused = isinstance(mask, BlockMask) and x.is_cuda and half & (half - 1) == 0
        q = attention_heads(self.q_proj(x), self.q_norm, positions_q, inv_freq, self.key_heads, fused)
        k = attention_heads(
            torch.cat([self.k_proj(context), self.k_proj(x)]),
            self.k_norm,
            positions_kv,
            inv_freq,
            self.key_heads,
            fused,
        )
        v = torch.cat([self.v_proj(context), self.v_proj(x)]).unflatten(-1, (-1, self.head_dim))
        v = pack_heads(v, self.key_heads)
        return self.o_proj(attend(q, k, v, mask, self.group).flatten(1))


class MLP(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, context, inv_freq, positions_q, positions_kv, mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), context, inv_freq, positions_q, positions_kv, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """`head` (the target's frozen embeddings and LM head) is held as plain tensors: it moves with
    `.to()` but is not a parameter, buffer or state-dict entry.

    attention="flex" uses flex-attention, except on the CPU with gradients enabled (flex-attention has
    no CPU backward), where it falls back to the dense reference; attention="dense" always uses the
    reference. `tile` is the BlockMask tile size. `compile_regions` turns the eager drafter's hot parts
    into regions compiled for dynamic shapes (drafter/regions.py)."""

    def __init__(self, config: DrafterConfig, head: TargetHead | None = None, attention: str = "flex", tile: int = 128):
        super().__init__()
        self.config = config
        width = len(config.target_layer_ids) * config.target_hidden_size
        self.fc = nn.Linear(config.subspace_rank or width, config.hidden_size, bias=False)
        if config.subspace_rank:  # set from the cache (train/model.py); a buffer, so checkpoints carry it
            self.register_buffer("subspace_basis", torch.zeros(width, config.subspace_rank))
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.register_buffer("inv_freq", rotary_frequencies(config.head_dim, config.rope_theta), persistent=False)
        self.head = head
        self.attention = attention
        # A BlockMask tile holds whole GQA groups of query rows (masks.block_mask): 128 rows and SmolLM2's
        # groups of 3 take 384-row tiles, still a multiple of the flex-attention kernels' blocks.
        self.tile = math.lcm(tile, config.num_attention_heads // config.num_key_value_heads)
        self.loss_terms = chunk_terms
        self.regions_backend = None
        self.reset_parameters()

    def compile_regions(self, backend: str | Callable = "inductor") -> None:
        """Each decoder layer, the context projection and the loss's per-chunk math become regions
        compiled for dynamic shapes; once per drafter."""
        if self.regions_backend is not None:
            return
        for layer in self.layers:
            layer.forward = region(layer.forward, backend)
        self.project_context = region(self.project_context, backend)
        self.loss_terms = region(chunk_terms, backend)
        self.regions_backend = backend

    def reset_parameters(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def _apply(self, fn, recurse: bool = True):
        if self.head is not None:
            self.head = self.head.apply(fn)
        return super()._apply(fn, recurse)

    def compute_dtype(self, device: torch.device) -> torch.dtype:
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        return self.fc.weight.dtype

    def masks(self, inputs: DraftInputs) -> BatchMasks:
        """This batch's attention masks (the eager runner builds them outside the regions; the compiled
        drafter inside its graph)."""
        layout = BlockLayout.build(inputs.seq_ids, inputs.positions, inputs.anchors, self.config.block_size, self.tile)
        dense = self.attention == "dense" or (layout.q_seq.device.type == "cpu" and torch.is_grad_enabled())
        group = self.config.num_attention_heads // self.config.num_key_value_heads
        return BatchMasks.build(layout, self.config.layer_types, self.config.sliding_window, dense, self.tile, group)

    def block_states(self, inputs: DraftInputs, masks: BatchMasks | None = None) -> torch.Tensor:
        """The final (normed) hidden states of every block, [A, B, H]."""
        if self.head is None:
            raise DFlashCacheError("the drafter has no target head; load CACHE/target/head.safetensors first.")
        masks = self.masks(inputs) if masks is None else masks
        config, dtype = self.config, self.compute_dtype(inputs.hidden.device)
        a, b = inputs.anchors.shape[0], config.block_size
        context = self.project_context(inputs.hidden.to(dtype))

        slot = torch.arange(b, device=inputs.anchors.device)
        tokens = torch.where(slot == 0, inputs.input_ids[inputs.anchors][:, None], config.mask_token_id)
        x = F.embedding(tokens.reshape(-1), self.head.embed_tokens).to(dtype)

        positions_q = masks.layout.q_pos[: a * b]
        positions_kv = torch.cat([inputs.positions, positions_q])
        for layer, kind in zip(self.layers, config.layer_types):
            x = layer(x, context, self.inv_freq, positions_q, positions_kv, masks.by_type[kind])
        return self.norm(x).unflatten(0, (a, b))

    def project_context(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, L*H_target] target hidden states, or [N, k] coordinates for a subspace drafter -> [N, H] context."""
        if self.config.subspace_rank and hidden.shape[-1] != self.config.subspace_rank:
            hidden = hidden @ self.subspace_basis.to(hidden.dtype)  # full states, from a live target
        return self.hidden_norm(self.fc(hidden))

    def forward(
        self,
        inputs: DraftInputs,
        masks: BatchMasks | None = None,
        gamma: float = 7.0,
        labels: str = "target",
        loss: str = LOSSES[0],
        dpace_alpha: float = DPACE_ALPHA,
    ) -> DrafterLoss:
        return drafter_loss(
            self.block_states(inputs, masks),
            self.head.lm_head,
            inputs,
            gamma,
            labels,
            self.loss_terms,
            loss,
            dpace_alpha,
        )
