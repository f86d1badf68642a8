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


def gradient_norm(parameters) -> torch.Tensor:
    """The total 2-norm of the parameters' gradients (clip_grad_norm_'s, without the clipping)."""
    return torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])


def clipped_step(optimizer: torch.optim.Optimizer, total_norm: torch.Tensor, max_norm: float) -> None:
    """`optimizer.step()` on gradients clipped as clip_grad_norm_ clips them: scaled by
    max_norm / (total_norm + 1e-6) where that is below 1. A fused AdamW divides each gradient by its
    `grad_scale` (the attribute torch's GradScaler sets) as it reads it, so there the clipping makes
    no pass over the gradients of its own (4 ms of a 255 ms drafter step on the H200, session 10)."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not params:
        return
    if all(group["fused"] for group in optimizer.param_groups):
        divisor = ((total_norm.float() + 1e-6) / max_norm).clamp(min=1.0)
        optimizer.grad_scale = divisor.to(params[0].device)
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale
        return
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm)
    optimizer.step()


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """The multiplier of the base learning rate at optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class Schedule:
    """Sets every parameter group's learning rate to its base rate times `lr_factor` of the step about to
    run. A function of the step count alone: a step skipped for a non-finite loss still moves the
    schedule on, without pretending an optimizer step happened (torch's LR schedulers warn when
    stepped without one). Its state is the step count."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float):
        self.optimizer = optimizer
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self.warmup_steps, self.total_steps, self.min_lr_ratio = warmup_steps, total_steps, min_lr_ratio
        self.steps = 0
        self._apply()

    def _apply(self) -> None:
        factor = lr_factor(self.steps, self.warmup_steps, self.total_steps, self.min_lr_ratio)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * factor

    def step(self) -> None:
        self.steps += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        # `last_epoch`: a checkpoint written when this was torch's LambdaLR, which counts steps the same way.
        self.steps = int(state["steps"] if "steps" in state else state["last_epoch"])
        self._apply()


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                    min_lr_ratio: float = 0.1) -> Schedule:
    return Schedule(optimizer, warmup_steps, total_steps, min_lr_ratio)
