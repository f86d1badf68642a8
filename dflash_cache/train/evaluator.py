"""`Evaluator`: the held-out loss, τ and first-slot accuracy every --eval-every steps and at the end."""

from __future__ import annotations

import torch

from dflash_cache.drafter.anchors import sample_anchors
from dflash_cache.drafter.runner import DrafterRunner
from dflash_cache.errors import DFlashCacheError
from dflash_cache.stream.epochs import EVAL, batch_seed, held_out_batches
from dflash_cache.target.precision import drafter_autocast
from dflash_cache.train.budget import is_out_of_memory, out_of_memory
from dflash_cache.train.config import TrainConfig
from dflash_cache.train.distributed import Rank, all_reduce_sum
from dflash_cache.train.metrics import StepMetrics
from dflash_cache.train.source import Source
from dflash_cache.train.state import TrainState

# Summed over the held-out batches and ranks: loss, tau * blocks, blocks, slot-1 hits, slot-1 counted, batches.
STATS = 6


class Evaluator:
    """Every rank evaluates, even one with no held-out batch (the sums are all-reduced). `follow`: the
    held-out samples are those of a followed cache committed so far, looked up again each time."""

    def __init__(
        self,
        runner: DrafterRunner,
        source: Source,
        cfg: TrainConfig,
        me: Rank,
        block_size: int,
        per_batch: int | None,
        total: int,
        metrics: StepMetrics,
        eval_keys: list[int],
        follow: bool,
    ):
        self.runner, self.source, self.cfg, self.me = runner, source, cfg, me
        self.block_size, self.per_batch, self.total = block_size, per_batch, total
        self.metrics, self.follow = metrics, follow
        self._hold_out(eval_keys)

    def _hold_out(self, eval_keys: list[int]) -> None:
        cfg = self.cfg
        self.eval_keys = eval_keys
        self.held_out = held_out_batches(
            self.eval_keys, self.source.lengths, cfg.token_budget, cfg.seed, self.me.rank, self.me.world
        )

    def after_step(self, state: TrainState) -> None:
        if not (state.step % self.cfg.eval_every == 0 or state.step == self.total):
            return
        if self.follow:
            self._hold_out(self.source.split(self.cfg.eval_fraction)[1])
        if self.eval_keys:
            self.metrics.eval({"step": state.step, **self.evaluate()})

    @torch.no_grad()
    def evaluate(self) -> dict:
        cfg, me = self.cfg, self.me
        stats = torch.zeros(STATS, device=me.device, dtype=torch.float64)
        with self.source.batches([b for _, b in self.held_out], me.device) as loader:
            for (index, _), batch in zip(self.held_out, loader):
                generator = torch.Generator(me.device).manual_seed(batch_seed(cfg.seed, EVAL, 0, index))
                anchors = sample_anchors(batch, self.block_size, cfg.max_anchors, generator, max_total=self.per_batch)
                try:
                    with drafter_autocast(me.device):
                        out = self.runner(
                            batch,
                            anchors,
                            gamma=cfg.gamma,
                            labels=cfg.labels,
                            loss=cfg.loss,
                            dpace_alpha=cfg.dpace_alpha,
                        )
                except (torch.OutOfMemoryError, RuntimeError) as e:
                    if not is_out_of_memory(e):
                        raise
                    where = f"evaluating {self.source.describe_batch(batch)}"
                    raise DFlashCacheError(out_of_memory(me.device, where, cfg.token_budget, cfg.max_anchors)) from None
                stats += torch.stack(
                    [
                        out.loss.double(),
                        (out.tau * out.num_blocks).double(),
                        out.num_blocks.double(),
                        out.correct[0].double(),
                        out.total[0].double(),
                        torch.tensor(1.0, device=me.device, dtype=torch.float64),
                    ]
                )
        loss, tau_blocks, blocks, hits, counted, batches = all_reduce_sum(stats).tolist()
        return {
            "eval_loss": loss / max(batches, 1),
            "eval_tau": tau_blocks / max(blocks, 1),
            "eval_acc_1": hits / max(counted, 1),
            "eval_batches": int(batches),
        }
