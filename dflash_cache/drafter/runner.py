"""Run a drafter on a FeatureBatch, eagerly or compiled.

Eager (default): the module runs on shapes that change every batch, with no padding; on a GPU its
decoder layers, context projection and loss math run as regions compiled once for dynamic shapes
(drafter/regions.py). Compiled: the module runs under `torch.compile` on inputs padded to a fixed
token and anchor budget, so one graph serves every batch.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_cache.choices import DPACE_ALPHA, LOSSES
from dflash_cache.drafter.inputs import DraftInputs
from dflash_cache.drafter.loss import DrafterLoss
from dflash_cache.errors import DFlashCacheError
from dflash_cache.stream.batch import FeatureBatch


class DrafterRunner:
    """`module` is a DFlashDrafter or a wrapper with the same forward (DDP). `regions` (eager only)
    defaults to on where the drafter's weights are on a GPU. `compile_mode` is torch.compile's `mode`
    for the compiled drafter (None: Inductor's default)."""

    def __init__(
        self,
        module: nn.Module,
        compiled: bool = False,
        token_budget: int | None = None,
        anchor_budget: int | None = None,
        backend: str = "inductor",
        regions: bool | None = None,
        compile_mode: str | None = None,
    ):
        if compiled and (token_budget is None or anchor_budget is None):
            raise DFlashCacheError("the compiled drafter needs a token budget and an anchor budget.")
        self.drafter = getattr(module, "module", module)
        self.compiled = compiled
        self.token_budget = token_budget
        self.anchor_budget = anchor_budget
        self.compile_mode = compile_mode
        self.forward = torch.compile(module, dynamic=False, backend=backend, mode=compile_mode) if compiled else module
        if regions is None:
            regions = not compiled and next(self.drafter.parameters()).device.type == "cuda"
        if regions:
            self.drafter.compile_regions(backend)

    def __call__(
        self,
        batch: FeatureBatch,
        anchors: torch.Tensor,
        gamma: float = 7.0,
        labels: str = "target",
        loss: str = LOSSES[0],
        dpace_alpha: float = DPACE_ALPHA,
    ) -> DrafterLoss:
        inputs = DraftInputs.build(batch, anchors)
        if self.compiled:
            inputs = inputs.padded(self.token_budget, self.anchor_budget, self.drafter.config.block_size)
        # The compiled drafter builds its masks inside its graph: built outside, their dozens of small
        # kernels ran while the GPU waited.
        masks = None if self.compiled else self.drafter.masks(inputs)
        if self.compile_mode == "reduce-overhead":  # CUDA-graph trees: each call is a new step
            torch.compiler.cudagraph_mark_step_begin()
        return self.forward(inputs, masks, gamma=gamma, labels=labels, loss=loss, dpace_alpha=dpace_alpha)
