"""The global batch plan of each epoch, and each rank's share of it in optimizer steps.

The plan of epoch e is `plan_batches(keys, lengths, token_budget, seed, e)`: the same for every
world size. Rank r takes plan positions r, r + W, r + 2W, ... (`shard_for_rank`), and one optimizer
step uses `grad_accum` of them on every rank, so step s of an epoch trains on plan positions
s*W*K .. (s+1)*W*K - 1 whatever W and K are, as long as W*K is the same. Plan batches left over
after the last whole step are not used in that epoch (a different few each epoch).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from dflash_cache.data.plan import describe_plan, plan_batches, shard_for_rank
from dflash_cache.errors import DFlashCacheError


class EpochPlan:
    def __init__(
        self,
        keys: Sequence[int],
        lengths: Sequence[int],
        token_budget: int,
        seed: int,
        world: int,
        grad_accum: int,
        epoch_steps: dict[int, int] | None = None,
    ):
        """`keys`: the samples to train on; `lengths[key]`: their lengths (indexed by key);
        `epoch_steps`: steps per epoch already counted by another plan of the same run (`epoch_steps`),
        so that a rank does not plan every epoch again before its first step."""
        self.keys = list(keys)
        self.lengths = lengths
        self.token_budget = token_budget
        self.seed = seed
        self.world = world
        self.grad_accum = grad_accum
        self.batches = lru_cache(maxsize=2)(self._batches)
        self.epoch_steps: dict[int, int] = dict(epoch_steps or {})

    def _batches(self, epoch: int) -> list[list[int]]:
        return plan_batches(self.keys, [self.lengths[k] for k in self.keys], self.token_budget, self.seed, epoch)

    def steps_in_epoch(self, epoch: int) -> int:
        if epoch not in self.epoch_steps:
            self.epoch_steps[epoch] = len(self.batches(epoch)) // (self.world * self.grad_accum)
        return self.epoch_steps[epoch]

    def rank_batches(self, epoch: int, rank: int) -> list[list[int]]:
        """This rank's batches of `epoch`, in step order (`grad_accum` per step)."""
        share = shard_for_rank(self.batches(epoch), rank, self.world)
        return share[: self.steps_in_epoch(epoch) * self.grad_accum]

    def segment(self, epoch: int, part: int, rank: int) -> tuple[list[list[int]], int, bool]:
        """An epoch in parts, as a following run plans its first one (stream/follow.py): here one part,
        the whole epoch: (this rank's batches, the plan position of the first, whether it is the last part)."""
        return self.rank_batches(epoch, rank), 0, True

    def global_index(self, local_index: int, rank: int) -> int:
        """The plan position of this rank's `local_index`-th batch of an epoch."""
        return local_index * self.world + rank

    def total_steps(self, epochs: int | None, steps: int | None) -> int:
        if not self.keys:
            raise DFlashCacheError("no samples left to train on (is --eval-fraction holding out all of them?)")
        if self.steps_in_epoch(0) == 0:
            raise DFlashCacheError(
                f"an epoch has {len(self.batches(0))} batches of {self.token_budget} tokens, fewer than one step needs "
                f"({self.world} ranks x {self.grad_accum} accumulated batches); lower --token-budget or --grad-accum"
            )
        if steps is not None:
            return steps
        return sum(self.steps_in_epoch(e) for e in range(epochs or 1))

    def describe(self, epoch: int = 0) -> list[str]:
        return describe_plan(self.batches(epoch), self.lengths)

    def anchor_bound(self, epoch: int, block_size: int, max_anchors: int) -> int:
        """The most anchors any batch of `epoch` can get: a fixed anchor budget for the compiled drafter."""
        fits = lambda n: min(max_anchors, max(0, n - block_size + 1))
        return max(sum(fits(self.lengths[k]) for k in b) for b in self.batches(epoch))


def held_out_batches(
    keys: Sequence[int], lengths: Sequence[int], token_budget: int, seed: int, rank: int, world: int
) -> list[tuple[int, list[int]]]:
    """This rank's share of the held-out plan as (plan position, batch); together the ranks cover
    every held-out batch, so a rank may get one batch more than another."""
    batches = plan_batches(list(keys), [lengths[k] for k in keys], token_budget, seed, 0)
    return list(zip(range(rank, len(batches), world), shard_for_rank(batches, rank, world, drop_remainder=False)))


TRAIN, EVAL = 0, 1


def batch_seed(seed: int, purpose: int, epoch: int, index: int) -> int:
    """A well-mixed seed for the random draws (anchors) of plan position `index` of `epoch`;
    `purpose` (TRAIN or EVAL) keeps the two plans' draws apart."""
    return int(np.random.SeedSequence([seed, purpose, epoch, index]).generate_state(1, np.uint64)[0] >> np.uint64(1))
