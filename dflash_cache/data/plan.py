"""Length buckets and token-budget batches, shared by extraction and training.

A plan is a sequence of batches, each a list of sample ids, held compactly (`Batches`). Samples
are grouped into length buckets (boundaries at powers of two and 1.5x powers of two, so lengths
inside a bucket differ by at most 1.5x) and batches never cross a bucket, so a batch holds samples
of similar length: packed it wastes no tokens, padded it wastes little. Each batch is filled up to
the token budget (the sum of its samples' lengths); a sample longer than the budget gets a batch of
its own.

Without a seed the plan is deterministic from the data (extraction): samples sorted by
(length, id) inside each bucket, buckets from long to short. Long first, because a batch that does
not fit in memory then shows at once, and because the last batch is the one whose compression and
write nothing overlaps: short samples compress in parallel, one long sample on one thread. With a seed (training) samples are
shuffled inside their bucket and the batch order is shuffled, both from a numpy Generator seeded by
(seed, epoch), so every rank computes the same global plan whatever the world size.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from dflash_cache.errors import DFlashCacheError


class Batches(Sequence[list[int]]):
    """A plan held in two arrays: every batch's sample ids, batch after batch, and where each batch
    starts. 8 bytes a sample where lists of Python ints cost about 40: every rank makes the whole
    plan, and turns only its own share into lists (`batches[rank::world]` is a list of lists)."""

    def __init__(self, ids: np.ndarray, starts: np.ndarray):
        self.ids = np.asarray(ids, dtype=np.int64)  # [N] sample ids in plan order
        self.starts = np.asarray(starts, dtype=np.int64)  # [B + 1] batch b is ids[starts[b]:starts[b + 1]]

    @classmethod
    def from_lists(cls, batches: Sequence[Sequence[int]]) -> Batches:
        sizes = [len(b) for b in batches]
        ids = np.fromiter((sid for b in batches for sid in b), dtype=np.int64, count=sum(sizes))
        return cls(ids, np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]))

    def __len__(self) -> int:
        return len(self.starts) - 1

    def reordered(self, order: np.ndarray) -> Batches:
        """The same batches, batch order[0] first, then order[1], ..."""
        sizes = np.diff(self.starts)[order]
        # the position in self.ids of every sample, batch after batch in the new order
        within = np.arange(sizes.sum()) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        return Batches(
            self.ids[np.repeat(self.starts[:-1][order], sizes) + within], np.concatenate([[0], np.cumsum(sizes)])
        )

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.ids[self.starts[index] : self.starts[index + 1]].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        for start, end in zip(self.starts[:-1].tolist(), self.starts[1:].tolist()):
            yield self.ids[start:end].tolist()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Batches):
            return np.array_equal(self.ids, other.ids) and np.array_equal(self.starts, other.starts)
        return (
            isinstance(other, Sequence) and len(other) == len(self) and all(a == list(b) for a, b in zip(self, other))
        )

    __hash__ = None

    def __repr__(self) -> str:
        return f"Batches({len(self)} batches of {len(self.ids)} samples)"


def length_buckets(max_length: int, smallest: int = 64) -> list[int]:
    """Boundaries b: bucket k holds lengths in [b[k], b[k+1]), from 1 to max_length inclusive."""
    bounds = [1]
    edge = smallest
    while edge <= max_length:
        bounds += [b for b in (edge, edge * 3 // 2) if b <= max_length]
        edge *= 2
    return bounds + [max_length + 1]


def plan_batches(
    sample_ids: Sequence[int],
    lengths: Sequence[int],
    token_budget: int,
    seed: int | None,
    epoch: int = 0,
) -> Batches:
    """Batches of sample ids; `lengths[i]` is the length of `sample_ids[i]`."""
    if token_budget < 1:
        raise DFlashCacheError(f"token budget must be positive, got {token_budget}")
    ids = np.asarray(sample_ids, dtype=np.int64)
    lens = np.asarray(lengths, dtype=np.int64)
    if ids.shape != lens.shape:
        raise ValueError(f"{len(ids)} sample ids but {len(lens)} lengths")
    if len(ids) == 0:
        return Batches(ids, np.zeros(1, dtype=np.int64))
    if lens.min() < 1:
        raise DFlashCacheError(f"sample {int(ids[lens.argmin()])} has no tokens")
    bucket = _bucket_of(lens, length_buckets(int(lens.max())))
    rng = np.random.default_rng([seed, epoch]) if seed is not None else None
    order, starts = [], [np.zeros(1, dtype=np.int64)]
    for k in np.unique(bucket)[::-1] if rng is None else np.unique(bucket):
        members = np.flatnonzero(bucket == k)
        if rng is None:
            members = members[np.lexsort((ids[members], lens[members]))]
        else:
            members = members[rng.permutation(len(members))]
        starts.append(_fill(lens[members], token_budget) + sum(map(len, order)))
        order.append(members)
    plan = Batches(ids[np.concatenate(order)], np.concatenate(starts))
    return plan if rng is None else plan.reordered(rng.permutation(len(plan)))


def _fill(lengths: np.ndarray, token_budget: int) -> np.ndarray:
    """Where the batches after the first end, and the end: filled in order up to the budget."""
    ends, tokens = array("q"), 0
    for i, length in enumerate(lengths.tolist()):
        if tokens and tokens + length > token_budget:
            ends.append(i)
            tokens = 0
        tokens += length
    ends.append(len(lengths))
    return np.frombuffer(ends, dtype=np.int64)


def _bucket_of(lengths: np.ndarray, bounds: list[int]) -> np.ndarray:
    return np.searchsorted(bounds, lengths, side="right") - 1


def shard_for_rank(
    batches: list[list[int]], rank: int, world_size: int, drop_remainder: bool = True
) -> list[list[int]]:
    """This rank's batches: plan positions rank, rank + W, rank + 2W, ...

    With `drop_remainder` (training) every rank gets len(batches) // W batches, so DDP ranks take
    the same number of steps; the last len(batches) % W batches of the plan are left out of that
    epoch (a shuffled plan leaves out a different few each epoch). Without it (work that must cover
    every batch) the first len(batches) % W ranks get one batch more.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    share = batches[rank::world_size]
    return share[: len(batches) // world_size] if drop_remainder else share


def describe_plan(batches: list[list[int]], lengths: Mapping[int, int] | Sequence[int]) -> list[str]:
    """Summary lines: batch count and sequences per batch, then the batches of each bucket.

    `lengths[sample_id]` is a sample's length; a batch's bucket is that of its longest sample.
    """
    if not batches:
        return ["Batches per epoch: 0"]
    sizes = np.array([len(b) for b in batches])
    longest = np.array([max(lengths[i] for i in b) for b in batches])
    bounds = length_buckets(int(longest.max()))
    lines = [f"Batches per epoch: {len(batches)} of {sizes.min()} to {sizes.max()} sequences (avg {sizes.mean():.1f})"]
    bucket = _bucket_of(longest, bounds)
    for k, count in zip(*np.unique(bucket, return_counts=True)):
        share = 100.0 * count / len(batches)
        lines.append(f"Bucket {k}, longest sample [{bounds[k]},{bounds[k + 1]}) tokens: {count} batches ({share:.1f}%)")
    return lines
