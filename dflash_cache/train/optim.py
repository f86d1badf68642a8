"""AdamW and the learning-rate schedule: linear warmup, then cosine decay to `min_lr_ratio * lr`."""

from __future__ import annotations

import math

import torch


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float,
                    betas: tuple[float, float] = (0.9, 0.95)) -> torch.optim.AdamW:
    """Weight decay on matrices only; norms and biases are not decayed. On a GPU the update is one
    compiled function (CompiledAdamW), elsewhere torch's own."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    if bool(params) and params[0].is_cuda:
        return CompiledAdamW(groups, lr=lr, betas=betas)
    return torch.optim.AdamW(groups, lr=lr, betas=betas)


def adamw_update(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                 exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], lr: torch.Tensor, divisor: torch.Tensor,
                 beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """torch.optim.AdamW's update (decoupled weight decay, no amsgrad), tensor by tensor, on the gradients
    divided by `divisor`. `lr` and `divisor` are 0-d tensors on the parameters' device, so that one
    compiled update serves every step."""
    for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        step += 1
        g = g / divisor
        p.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / (1 - beta2**step).sqrt()).add_(eps)
        p.sub_(m / denom * (lr / (1 - beta1**step)))


class CompiledAdamW(torch.optim.AdamW):
    """torch's AdamW (its parameter groups, state and state dict) whose step runs `adamw_update` compiled:
    each parameter's update is one fused kernel, reading and writing its bytes once. On an H200, for
    the 27B drafter's 1.73 B parameters: 11.7 ms a step with the clipping, against 13.9 ms for torch's
    fused AdamW without it, side by side (benchmarks/optimizer.py, BENCHMARKS.md session 15). `step(grad_divisor=...)` divides the
    gradients as it reads them (clipped_step's clipping)."""

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.01,
                 eps: float = 1e-8, compile: bool = True):
        # capturable: a loaded checkpoint's step counts stay on the parameters' device
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, capturable=True)
        self.update = torch.compile(adamw_update) if compile else adamw_update
        self.scalars: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _scalar_tensors(self, device: torch.device, lr: float, divisor: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(lr, divisor) as 0-d tensors on `device`, refilled in place (from a divisor on any device):
        torch.tensor(x, device=cuda) would wait for the GPU."""
        if device not in self.scalars:
            self.scalars[device] = (torch.zeros((), device=device), torch.ones((), device=device))
        lr_tensor, divisor_tensor = self.scalars[device]
        lr_tensor.fill_(lr)
        if divisor is None:
            divisor_tensor.fill_(1.0)
        else:
            divisor_tensor.copy_(divisor)
        return lr_tensor, divisor_tensor

    @torch.no_grad()
    def step(self, closure=None, grad_divisor: torch.Tensor | None = None):
        if closure is not None:
            raise ValueError("CompiledAdamW takes no closure")
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                elif state["step"].device != p.device:
                    state["step"] = state["step"].to(p.device)
            states = [self.state[p] for p in params]
            lr, divisor = self._scalar_tensors(params[0].device, group["lr"], grad_divisor)
            beta1, beta2 = group["betas"]
            self.update(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                        [s["exp_avg_sq"] for s in states], [s["step"] for s in states], lr, divisor,
                        beta1, beta2, group["eps"], group["weight_decay"])


def gradient_norm(parameters) -> torch.Tensor:
    """The total 2-norm of the parameters' gradients (clip_grad_norm_'s, without the clipping)."""
    return torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])


def clipped_step(optimizer: torch.optim.Optimizer, total_norm: torch.Tensor, max_norm: float) -> None:
    """`optimizer.step()` on gradients clipped as clip_grad_norm_ clips them: scaled by
    max_norm / (total_norm + 1e-6) where that is below 1. CompiledAdamW divides each gradient by that
    factor as it reads it, so there the clipping makes no pass over the gradients of its own (4 ms of a
    255 ms drafter step on the H200, session 10)."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not params:
        return
    if isinstance(optimizer, CompiledAdamW):
        divisor = ((total_norm.float() + 1e-6) / max_norm).clamp(min=1.0)
        optimizer.step(grad_divisor=divisor)
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
