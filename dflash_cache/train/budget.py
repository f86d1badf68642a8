"""What a drafter step costs in memory, the device-dependent defaults, and the check that a step fits.

The estimate counts, for the plan's most demanding batch (N tokens, at most A anchors, Q = A x block
queries): fp32 weights (with gradients and two AdamW moments when training; Muon keeps one), the target head in the
step's dtype, the packed hidden states, per decoder layer the activations kept for backward (the queries'
projections, norms and MLP, the context keys and values), the dense-mask attention's memory per
(query, key) pair on the CPU (a GPU runs flex-attention, which holds no such grid), and the chunked
LM-head logits. The step's dtype is bf16, or fp32 on a CPU slow at bf16 products (target/precision.py),
which doubles the head and the activations that autocast would keep in bf16. It is an estimate, to refuse
a budget that cannot fit before the first step.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dflash_cache.console.units import size as gb
from dflash_cache.drafter.config import DrafterConfig
from dflash_cache.drafter.defaults import parameter_count
from dflash_cache.drafter.head_loss import LOGITS_PER_CHUNK
from dflash_cache.errors import DFlashCacheError
from dflash_cache.train.config import CPU_DEFAULTS, GPU_DEFAULTS

# Where the plan's largest batch would not fit on a GPU, the default caps a batch's blocks to fit in this share
# of its total memory (not of what is free, so that a resumed run gets the same cap).
GPU_SHARE = 0.85
BF16, FP32 = 2, 4
# The dense-mask attention holds about this many bytes per (query, key) pair of a batch: the bool mask,
# its float form and the kernel's working memory, measured on a CPU (torch 2.13:
# 1.03, 2.53 and 5.22 GB at 38, 130 and 314 million pairs, with the per-query terms below).
DENSE_PAIR_BYTES = 10


def device_defaults(device_type: str) -> tuple[int, int]:
    return GPU_DEFAULTS if device_type == "cuda" else CPU_DEFAULTS


@dataclass
class StepMemory:
    weights: int  # drafter weights (+ gradients and optimizer state when training)
    head: int  # the frozen target head
    activations: int  # the largest batch's
    tokens: int  # of the largest batch
    blocks: int  # its most anchors

    @property
    def total(self) -> int:
        return self.weights + self.head + self.activations

    def describe(self) -> str:
        return (
            f"about {gb(self.total)} per step (weights and optimizer {gb(self.weights)}, target head "
            f"{gb(self.head)}, activations {gb(self.activations)} for the largest batch: {self.tokens:,} tokens, "
            f"up to {self.blocks:,} blocks)"
        )


def batch_anchors(lengths: Sequence[int], block_size: int, max_anchors: int, per_batch: int | None = None) -> int:
    """The most anchors a batch of sequences of these lengths can get (at most `per_batch` in all)."""
    most = sum(min(max_anchors, max(0, n - block_size + 1)) for n in lengths)
    return most if per_batch is None else min(most, per_batch)


def activation_bytes(
    config: DrafterConfig, tokens: int, anchors: int, dense_mask: bool, training: bool, work: int = BF16
) -> int:
    """`work`: the bytes of an element of the step's dtype."""
    h, f = config.hidden_size, config.intermediate_size
    q_width = config.num_attention_heads * config.head_dim
    kv_width = config.num_key_value_heads * config.head_dim
    q, n = anchors * config.block_size, tokens
    inputs = n * len(config.target_layer_ids) * config.target_hidden_size * BF16 + n * h * (work + FP32)
    # Per layer and query: the residual and norms (fp32 inside RMSNorm), q and its norm and rotation,
    # the attention output, the MLP's gate, up, activation and product, with their temporaries; per
    # context and block key: k and v projected, normed and rotated.
    per_layer = q * (6 * h * FP32 + 6 * q_width * work + 6 * f * work) + (n + q) * kv_width * 4 * work
    layers = config.num_hidden_layers if training else 1  # no_grad keeps one layer's live at a time
    pairs = q * (n + q) * DENSE_PAIR_BYTES if dense_mask else 0
    logits = 2 * min(q * config.vocab_size * FP32, LOGITS_PER_CHUNK * FP32) + q * h * work
    return inputs + layers * per_layer + pairs + logits


def estimate_step_memory(
    config: DrafterConfig,
    head_bytes: int,
    batches: Sequence[Sequence[int]],
    max_anchors: int,
    device_type: str,
    training: bool,
    per_batch: int | None = None,
    work: int = BF16,
) -> StepMemory:
    """`batches`: the lengths of each batch's sequences (the plan's); `per_batch`: a cap on a batch's anchors;
    `work`: the bytes of an element of the step's dtype. The CPU attends through a dense mask."""
    params = parameter_count(config)
    weights = params * (4 * FP32 if training else FP32)
    best = (0, 0, 0)
    for lengths in batches:
        tokens, anchors = sum(lengths), batch_anchors(lengths, config.block_size, max_anchors, per_batch)
        need = activation_bytes(config, tokens, anchors, device_type == "cpu", training, work)
        best = max(best, (need, tokens, anchors))
    return StepMemory(weights, head_bytes, best[0], best[1], best[2])


def fitting_anchor_cap(
    config: DrafterConfig,
    head_bytes: int,
    batches: Sequence[Sequence[int]],
    max_anchors: int,
    have: int,
    step: int = 64,
) -> int | None:
    """The most anchors per batch, a multiple of `step`, with which a GPU training step of every batch fits in
    `have` bytes; None when not even `step` anchors fit."""
    # A step's memory grows with its tokens and its anchors: only batches that no other batch exceeds in both
    # can be the largest, so those few are tried at each cap, not the whole plan.
    frontier, most = [], -1
    for tokens, anchors in sorted(
        ((sum(b), batch_anchors(b, config.block_size, max_anchors)) for b in batches), reverse=True
    ):
        if anchors > most:
            frontier.append((tokens, anchors))
            most = anchors
    fixed = estimate_step_memory(config, head_bytes, [], max_anchors, "cuda", True)
    fixed_bytes = fixed.weights + fixed.head

    def fits(cap: int) -> bool:
        return fixed_bytes + max(activation_bytes(config, t, min(a, cap), False, True) for t, a in frontier) <= have

    low, high = 0, -(-max(most, 0) // step)  # in units of `step`: low fits (or is 0)
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid * step) else (low, mid - 1)
    return low * step or None


def default_anchor_cap(
    config: DrafterConfig, batches: Sequence[Sequence[int]], max_anchors: int, gpu_bytes: int
) -> tuple[int | None, StepMemory]:
    """(the anchors-per-batch cap a GPU of `gpu_bytes` gets when none is given: None when the plan's batches
    fit in GPU_SHARE of it, or when not even a few anchors do; the uncapped estimate)."""
    head = head_bytes(config)
    need = estimate_step_memory(config, head, batches, max_anchors, "cuda", training=True)
    room = int(GPU_SHARE * gpu_bytes)
    return (None if need.total <= room else fitting_anchor_cap(config, head, batches, max_anchors, room)), need


def available_bytes(device: torch.device) -> tuple[int, str]:
    """(bytes a step may use, what they are): the GPU's free memory, or the RAM the OS has available."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free on {device}"
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024, "of RAM available"
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "of RAM available"


def check_fits(
    estimate: StepMemory,
    device: torch.device,
    token_budget: int,
    max_anchors: int,
    available: tuple[int, str] | None = None,
) -> None:
    """Stops before the first step when the estimate exceeds what the device has."""
    have, what = available or available_bytes(device)
    if estimate.total > have:
        raise DFlashCacheError(
            f"a step needs {estimate.describe()} but there is {gb(have)} {what}; lower --token-budget "
            f"(now {token_budget:,}) or --max-anchors (now {max_anchors:,}), or pick a smaller --drafter"
        )


def head_bytes(config: DrafterConfig, work: int = BF16) -> int:
    """The target head in the step's dtype (`work` bytes an element): embeddings and LM head [V, H], final norm [H]."""
    return (2 * config.vocab_size + 1) * config.hidden_size * work


def is_out_of_memory(error: BaseException) -> bool:
    """A GPU's OutOfMemoryError, or the CPU allocator's failure (a plain RuntimeError)."""
    return isinstance(error, torch.OutOfMemoryError) or "can't allocate memory" in str(error)


def out_of_memory(device: torch.device, where: str, token_budget: int, max_anchors: int) -> str:
    """The one line an out-of-memory error becomes: the device, the batch size, what to lower."""
    memory = "GPU memory" if device.type == "cuda" else "memory"
    return (
        f"out of {memory} on {device} {where}; lower --token-budget (now {token_budget:,}) or --max-anchors "
        f"(now {max_anchors:,})"
    )
