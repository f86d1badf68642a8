"""The optimizers (AdamW, or Muon with AdamW for the vectors) and the learning-rate schedule: linear
warmup, then cosine decay to `min_lr_ratio * lr`."""

from __future__ import annotations

import math

import torch

from dflash_cache.choices import OPTIMIZERS
from dflash_cache.target.precision import forward_dtype
from dflash_cache.train.muon import Muon


def build_optimizer(
    model: torch.nn.Module,
    lr: float,
    weight_decay: float,
    kind: str = OPTIMIZERS[0],
    betas: tuple[float, float] = (0.9, 0.95),
) -> torch.optim.Optimizer | MuonAdamW:
    """Weight decay on matrices only; norms and biases are not decayed. adamw: on a GPU the update is
    one compiled function (CompiledAdamW) and the model's matrices become bf16 working copies of fp32
    masters held by the optimizer; elsewhere torch's own AdamW on the fp32 weights. muon: MuonAdamW,
    fp32 weights everywhere."""
    params = [p for p in model.parameters() if p.requires_grad]
    matrices, vectors = [p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]
    if kind == "muon":
        return MuonAdamW(matrices, vectors, lr, weight_decay, betas)
    groups = [{"params": matrices, "weight_decay": weight_decay}, {"params": vectors, "weight_decay": 0.0}]
    if bool(params) and params[0].is_cuda:
        return CompiledAdamW(groups, lr=lr, betas=betas, bf16_matrices=True)
    return torch.optim.AdamW(groups, lr=lr, betas=betas)


class MuonAdamW:
    """torch's Muon over the drafter's matrices (each update orthogonalised, in the step's dtype: train/muon.py;
    its size matched to AdamW's update RMS at the same rate: adjust_lr_fn="match_rms_adamw") and torch.optim.AdamW over
    its vectors, undecayed, stepped as one optimizer: the schedule sets both parts' rates through
    `param_groups`, and `state_dict` is torch's layout with the parameters numbered across the parts.
    Every matrix here is 2-D (Muon takes nothing else) and none is the frozen embedding or LM head."""

    def __init__(
        self,
        matrices: list[torch.Tensor],
        vectors: list[torch.Tensor],
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        momentum: float = 0.95,
    ):
        self.parts: list[torch.optim.Optimizer] = []
        if matrices:
            ns_dtype = forward_dtype(matrices[0].device)
            self.parts.append(Muon(matrices, lr=lr, weight_decay=weight_decay, momentum=momentum, ns_dtype=ns_dtype))
        if vectors:
            self.parts.append(torch.optim.AdamW(vectors, lr=lr, betas=betas, weight_decay=0.0))

    @property
    def param_groups(self) -> list[dict]:
        return [group for part in self.parts for group in part.param_groups]

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        state, groups, offset = {}, [], 0
        for part in self.parts:
            saved = part.state_dict()
            state.update({offset + i: s for i, s in saved["state"].items()})
            groups += [{**g, "params": [offset + i for i in g["params"]]} for g in saved["param_groups"]]
            offset += sum(len(g["params"]) for g in part.param_groups)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, saved: dict) -> None:
        first_group, offset = 0, 0
        for part in self.parts:
            groups = saved["param_groups"][first_group : first_group + len(part.param_groups)]
            ids = [i for g in groups for i in g["params"]]
            part.load_state_dict(
                {
                    "state": {i - offset: saved["state"][i] for i in ids if i in saved["state"]},
                    "param_groups": [{**g, "params": [i - offset for i in g["params"]]} for g in groups],
                }
            )
            first_group, offset = first_group + len(groups), offset + len(ids)


def adamw_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    lr: torch.Tensor,
    divisor: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    masters: list[torch.Tensor] | None = None,
) -> None:
    """torch.optim.AdamW's update (decoupled weight decay, no amsgrad), tensor by tensor, on the gradients
    divided by `divisor`. `lr` and `divisor` are 0-d tensors on the parameters' device, so that one
    compiled update serves every step. With `masters`, the update is made to them in fp32 (from
    gradients of any float dtype) and each parameter becomes its master's copy in its own dtype."""
    for i, (p, g, m, v, step) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, steps)):
        w = p if masters is None else masters[i]
        step += 1
        g = g.float() / divisor
        w.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / (1 - beta2**step).sqrt()).add_(eps)
        w.sub_(m / denom * (lr / (1 - beta1**step)))
        if masters is not None:
            p.copy_(w)


class CompiledAdamW(torch.optim.AdamW):
    """torch's AdamW (its parameter groups, state and state dict) whose step runs `adamw_update` compiled:
    each parameter's update is one fused kernel, reading and writing its bytes once: near the copy floor of
    those bytes, and faster than torch's fused AdamW without the clipping (benchmarks/optimizer.py). `step(grad_divisor=...)` divides the
    gradients as it reads them (clipped_step's clipping).

    bf16_matrices: the fp32 matrices (2-D and larger parameters) become the optimizer's masters
    (`masters`, by parameter) and the parameters themselves bf16 copies of them, rewritten by each update.
    The forward then reads bf16 weights and the backward writes bf16 gradients, where bf16 autocast over
    fp32 weights cast every matrix each forward and every gradient back: with a prototype (the norms bf16
    too) the 27B drafter's compiled step was faster, side by side. The update's
    arithmetic and state stay fp32, and so does every vector (norms). Gradients accumulated over
    micro-batches, and averaged over ranks by DDP, are then summed in bf16. The masters are not in
    `state_dict()`: a checkpoint holds them as the drafter's weights (`full_precision_weights`,
    `load_full_precision_weights`)."""

    def __init__(
        self,
        params,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.01,
        eps: float = 1e-8,
        compile: bool = True,
        bf16_matrices: bool = False,
    ):
        # capturable: a loaded checkpoint's step counts stay on the parameters' device
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, capturable=True)
        self.update = torch.compile(adamw_update) if compile else adamw_update
        self.scalars: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.masters: dict[torch.Tensor, torch.Tensor] = {}
        if bf16_matrices:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.dim() >= 2 and p.dtype == torch.float32:
                        self.masters[p] = p.detach().clone()
                        p.data = p.data.to(torch.bfloat16)

    def _scalar_tensors(
        self, device: torch.device, lr: float, divisor: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
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
                    weights = self.masters.get(p, p)
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(weights, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(weights, memory_format=torch.preserve_format)
                elif state["step"].device != p.device:
                    state["step"] = state["step"].to(p.device)
            lr, divisor = self._scalar_tensors(params[0].device, group["lr"], grad_divisor)
            beta1, beta2 = group["betas"]
            # build_optimizer's groups hold matrices or vectors; another group may hold both
            for part in ([p for p in params if p in self.masters], [p for p in params if p not in self.masters]):
                if part:
                    states = [self.state[p] for p in part]
                    masters = [self.masters[p] for p in part] if part[0] in self.masters else None
                    self.update(
                        part,
                        [p.grad for p in part],
                        [s["exp_avg"] for s in states],
                        [s["exp_avg_sq"] for s in states],
                        [s["step"] for s in states],
                        lr,
                        divisor,
                        beta1,
                        beta2,
                        group["eps"],
                        group["weight_decay"],
                        masters,
                    )

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, except that the moments of a parameter with a master stay fp32 (torch casts every
        state tensor to its parameter's dtype)."""
        super().load_state_dict(state_dict)
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, p in zip(saved_ids, params):
            if p in self.masters and saved_id in state_dict["state"]:
                for key, value in state_dict["state"][saved_id].items():
                    if key != "step":
                        self.state[p][key] = value.to(device=p.device, dtype=torch.float32)


def full_precision_weights(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The model's state dict with each bf16 working matrix replaced by its fp32 master (CompiledAdamW's
    bf16_matrices): the weights a checkpoint stores."""
    masters = getattr(optimizer, "masters", {})
    names = {p: name for name, p in model.named_parameters()}
    state = model.state_dict()
    for p, master in masters.items():
        state[names[p]] = master
    return state


def load_full_precision_weights(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor]
) -> None:
    """Loads checkpoint `weights` into the model, each cast to its parameter's dtype, and into the
    optimizer's masters as they are."""
    masters = getattr(optimizer, "masters", {})
    current = model.state_dict()
    model.load_state_dict({name: t.to(current[name].dtype) for name, t in weights.items()})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p in masters:
                masters[p].copy_(weights[name])


def gradient_norm(parameters) -> torch.Tensor:
    """The total 2-norm of the parameters' gradients (clip_grad_norm_'s, without the clipping), in fp32
    whatever the gradients' dtype (torch's get_total_norm rounds each bf16 gradient's norm to bf16)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))


def clipped_step(optimizer: torch.optim.Optimizer, total_norm: torch.Tensor, max_norm: float) -> None:
    """`optimizer.step()` on gradients clipped as clip_grad_norm_ clips them: scaled by
    max_norm / (total_norm + 1e-6) where that is below 1. CompiledAdamW divides each gradient by that
    factor as it reads it, so there the clipping makes no pass over the gradients of its own."""
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


def build_scheduler(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1
) -> Schedule:
    return Schedule(optimizer, warmup_steps, total_steps, min_lr_ratio)
