"""`Checkpointer`: saves the run every --save-every steps and at its end, and restores it on resume."""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_cache.train.checkpoint import latest_checkpoint, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from dflash_cache.train.distributed import Rank, all_gather_objects
from dflash_cache.train.retention import prune_checkpoints
from dflash_cache.train.state import TrainState


class Checkpointer:
    def __init__(
        self,
        out: Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler,
        me: Rank,
        every: int,
        keep_last: int,
        total: int,
    ):
        self.out, self.model, self.optimizer, self.scheduler = out, model, optimizer, scheduler
        self.me, self.every, self.keep_last, self.total = me, every, keep_last, total
        self.saved_at = 0

    def restore(self) -> TrainState:
        """The latest checkpoint's weights, optimizer and scheduler loaded in place, this rank's RNG set."""
        restored = load_checkpoint(latest_checkpoint(self.out), self.model, self.optimizer, self.scheduler)
        set_rng_state(restored["rng"][self.me.rank])
        state = TrainState.from_dict(restored["position"])
        self.saved_at = state.step
        return state

    def after_step(self, state: TrainState) -> None:
        if self.every and (state.step % self.every == 0 or state.step == self.total):
            self.save(state)

    def finish(self, state: TrainState) -> None:
        """Save the run's last step, unless the cadence already did."""
        if self.every and self.saved_at != state.step:
            self.save(state)

    def save(self, state: TrainState) -> None:
        rngs = all_gather_objects(rng_state())  # every rank takes part
        if self.me.is_main:
            save_checkpoint(self.out, state.step, self.model, self.optimizer, self.scheduler, state.to_dict(), rngs)
            prune_checkpoints(self.out, self.keep_last)
        self.saved_at = state.step
