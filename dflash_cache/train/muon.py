"""torch's Muon with its Newton-Schulz iteration in a chosen dtype, shared out over the ranks.

torch.optim.Muon orthogonalises each update in bf16, which a CPU without bf16 matrix units emulates:
there a Muon step of a drafter's matrices takes tens of times as long as the same iteration in fp32
(BENCHMARKS.md, "Every default, on the CPU"). `Muon` makes torch's update, step for step, with the
iteration in the dtype the drafter's step computes in (target/precision.py).

The iteration is most of a large drafter's optimizer step, and under DDP every rank holds the same
gradients and momentum, so each would compute the same iterations. Instead each matrix has one owner
rank (`owners`: the costliest first, each to the least loaded rank), which orthogonalises it and
broadcasts the result; every rank then applies the same updates.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist


def orthogonalise(update: torch.Tensor, group: dict, dtype: torch.dtype) -> torch.Tensor:
    """The quintic Newton-Schulz iteration of torch.optim.Muon, in `dtype`: about U V^T for U S V^T = update."""
    a, b, c = group["ns_coefficients"]
    x = update.to(dtype, copy=True)  # normalised in place below; `update` may be the momentum buffer
    wide = update.size(0) <= update.size(1)
    x = x if wide else x.T
    x.div_(x.norm().clamp(min=group["eps"]))
    for _ in range(group["ns_steps"]):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x if wide else x.T


def iteration_cost(shape: torch.Size) -> int:
    """Multiply-adds of one Newton-Schulz round on a matrix of `shape` (a x b, a <= b: two a x a x b
    products and one a x a x a)."""
    a, b = sorted(shape)
    return 2 * a * a * b + a**3


def owners(shapes: list[torch.Size], world: int) -> list[int]:
    """The rank that orthogonalises each matrix: the costliest first, each to the rank with the least
    work so far (the lowest rank on a tie), so every rank derives the same assignment."""
    load, owner = [0] * world, [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-iteration_cost(shapes[i]), i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[i], load[rank] = rank, load[rank] + iteration_cost(shapes[i])
    return owner


class Muon(torch.optim.Muon):
    """torch.optim.Muon with adjust_lr_fn="match_rms_adamw" (the update's RMS matched to AdamW's) and
    the orthogonalisation in `ns_dtype`; its state and param_groups are torch's."""

    def __init__(self, params, lr: float, weight_decay: float, momentum: float, ns_dtype: torch.dtype):
        super().__init__(params, lr=lr, weight_decay=weight_decay, momentum=momentum, adjust_lr_fn="match_rms_adamw")
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self) -> None:
        todo = []  # (parameter, its group) of each matrix with a gradient, its momentum updated
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                state["momentum_buffer"].lerp_(p.grad, 1 - group["momentum"])
                todo.append((p, group))
        for (p, group), update in zip(todo, self._orthogonalised(todo)):
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(update, alpha=-group["lr"] * (0.2 * math.sqrt(max(p.shape))))

    def _orthogonal_update(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        buf = self.state[p]["momentum_buffer"]
        return orthogonalise(p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf, group, self.ns_dtype)

    def _orthogonalised(self, todo: list) -> Iterable[torch.Tensor]:
        """Each matrix's update, made one at a time as it is applied, or on several ranks each by its owner."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return (self._orthogonal_update(p, group) for p, group in todo)
        rank, owner = dist.get_rank(), owners([p.shape for p, _ in todo], dist.get_world_size())
        results = [
            self._orthogonal_update(p, group).contiguous()  # a tall matrix's comes back transposed
            if owner[i] == rank
            else torch.empty(p.shape, dtype=self.ns_dtype, device=p.device)
            for i, (p, group) in enumerate(todo)
        ]
        for work in [dist.broadcast(r, src=owner[i], async_op=True) for i, r in enumerate(results)]:
            work.wait()
        return results
