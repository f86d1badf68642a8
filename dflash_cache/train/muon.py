"""torch's Muon with its Newton-Schulz iteration in a chosen dtype.

torch.optim.Muon orthogonalises each update in bf16, which a CPU without bf16 matrix units emulates:
there a Muon step of a drafter's matrices takes tens of times as long as the same iteration in fp32
(BENCHMARKS.md, "Every default, on the CPU"). `Muon` makes torch's update, step for step, with the
iteration in the dtype the drafter's step computes in (target/precision.py).
"""

from __future__ import annotations

import math

import torch


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


class Muon(torch.optim.Muon):
    """torch.optim.Muon with adjust_lr_fn="match_rms_adamw" (the update's RMS matched to AdamW's) and
    the orthogonalisation in `ns_dtype`; its state and param_groups are torch's."""

    def __init__(self, params, lr: float, weight_decay: float, momentum: float, ns_dtype: torch.dtype):
        super().__init__(params, lr=lr, weight_decay=weight_decay, momentum=momentum, adjust_lr_fn="match_rms_adamw")
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                update = orthogonalise(update, group, self.ns_dtype)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"] * (0.2 * math.sqrt(max(p.shape))))
