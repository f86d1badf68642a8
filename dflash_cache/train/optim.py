"""AdamW and the learning-rate schedule: linear warmup, then cosine decay to `min_lr_ratio * lr`."""

from __future__ import annotations

import math

import torch


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float,
                    betas: tuple[float, float] = (0.9, 0.95)) -> torch.optim.AdamW:
    """Weight decay on matrices only; norms and biases are not decayed."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = bool(params) and params[0].is_cuda
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused)


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """The multiplier of the base learning rate at optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                    min_lr_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup_steps, total_steps, min_lr_ratio))
