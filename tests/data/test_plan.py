import re
from itertools import pairwise

import numpy as np
import pytest

from dflash_cache.data.plan import describe_plan, length_buckets, plan_batches, shard_for_rank
from dflash_cache.errors import DFlashCacheError

BUDGET = 4096


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(1, 2048, 3000), rng.integers(4000, 9000, 40)])  # some exceed the budget
    ids = rng.permutation(10_000)[: len(lengths)]  # ids need not be contiguous or sorted
    return ids.tolist(), lengths.tolist()


def batch_tokens(batch, length_of):
    return sum(length_of[i] for i in batch)


@pytest.mark.parametrize("seed", [None, 0, 1])
def test_every_sample_once_and_budget_respected(data, seed):
    ids, lengths = data
    length_of = dict(zip(ids, lengths))
    batches = plan_batches(ids, lengths, BUDGET, seed)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == sorted(ids)
    bounds = length_buckets(max(lengths))
    for b in batches:
        assert b
        if len(b) > 1:
            assert batch_tokens(b, length_of) <= BUDGET
        # batches never cross a length bucket
        assert len({np.searchsorted(bounds, length_of[i], side="right") for i in b}) == 1
    alone = [b for b in batches if batch_tokens(b, length_of) > BUDGET]
    assert all(len(b) == 1 for b in alone)
    assert len(alone) == sum(length > BUDGET for length in lengths)


def test_batches_are_full(data):
    """Greedy fill: a batch ends only at a bucket's end or where the next sample would not fit."""
    ids, lengths = data
    length_of = dict(zip(ids, lengths))
    bounds = length_buckets(max(lengths))

    def bucket(sample_id):
        return np.searchsorted(bounds, length_of[sample_id], side="right")

    batches = plan_batches(ids, lengths, BUDGET, None)
    for b, following in pairwise(batches):
        if bucket(b[-1]) == bucket(following[0]):
            assert batch_tokens(b, length_of) + length_of[following[0]] > BUDGET


def test_deterministic_plan_runs_buckets_long_to_short(data):
    ids, lengths = data
    length_of = dict(zip(ids, lengths))
    bounds = length_buckets(max(lengths))
    bucket_of = lambda i: int(np.searchsorted(bounds, length_of[i], side="right")) - 1
    batches = plan_batches(ids, lengths, BUDGET, None)
    flat = [i for b in batches for i in b]
    # buckets from the longest to the shortest, samples by (length, id) inside each
    assert [(-bucket_of(i), length_of[i], i) for i in flat] == sorted((-bucket_of(i), length_of[i], i) for i in flat)
    assert plan_batches(ids, lengths, BUDGET, None) == batches
    # the input order does not matter
    order = np.random.default_rng(5).permutation(len(ids))
    assert plan_batches([ids[i] for i in order], [lengths[i] for i in order], BUDGET, None) == batches


def test_seeded_plans(data):
    ids, lengths = data
    plan = plan_batches(ids, lengths, BUDGET, seed=7)
    assert plan == plan_batches(ids, lengths, BUDGET, seed=7)
    assert plan != plan_batches(ids, lengths, BUDGET, seed=8)
    assert plan != plan_batches(ids, lengths, BUDGET, seed=7, epoch=1)
    assert plan != plan_batches(ids, lengths, BUDGET, seed=None)


@pytest.mark.parametrize("world_size", [1, 2, 3, 7])
def test_rank_shares(data, world_size):
    ids, lengths = data
    batches = plan_batches(ids, lengths, BUDGET, seed=3)
    shares = [shard_for_rank(batches, r, world_size) for r in range(world_size)]
    assert len({len(s) for s in shares}) == 1  # every rank takes the same number of steps
    taken = [tuple(b) for s in shares for b in s]
    assert len(taken) == len(set(taken))  # disjoint
    kept = len(batches) - len(batches) % world_size
    assert sorted(taken) == sorted(tuple(b) for b in batches[:kept])  # all but the remainder
    assert len(batches) % world_size < world_size
    # Without dropping: disjoint and covering, counts differ by at most one.
    shares = [shard_for_rank(batches, r, world_size, drop_remainder=False) for r in range(world_size)]
    taken = sorted(tuple(b) for s in shares for b in s)
    assert taken == sorted(tuple(b) for b in batches)
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_exact_small_plan():
    batches = plan_batches([10, 11, 12, 13, 14], [3, 70, 2, 5, 64], token_budget=8, seed=None)
    # buckets, long first: [64,96) holds 14, 11 (64, 70 tokens); [1,64) holds 12, 10, 13 (2, 3, 5 tokens)
    assert batches == [[14], [11], [12, 10], [13]]


def test_bad_input():
    with pytest.raises(DFlashCacheError, match="token budget must be positive"):
        plan_batches([0], [5], token_budget=-1, seed=None)
    with pytest.raises(DFlashCacheError, match="sample 3 has no tokens"):
        plan_batches([1, 3], [5, 0], token_budget=10, seed=None)
    with pytest.raises(ValueError):
        shard_for_rank([[1]], rank=2, world_size=2)
    assert plan_batches([], [], token_budget=10, seed=1) == []


def test_length_buckets():
    assert length_buckets(8192)[:6] == [1, 64, 96, 128, 192, 256]
    assert length_buckets(8192)[-3:] == [6144, 8192, 8193]
    assert length_buckets(30) == [1, 31]
    bounds = length_buckets(100_000)
    assert all(b / a <= 1.5 for a, b in pairwise(bounds[1:]))


def test_describe_plan(data):
    ids, lengths = data
    length_of = dict(zip(ids, lengths))
    batches = plan_batches(ids, lengths, BUDGET, seed=0)
    lines = describe_plan(batches, length_of)
    sizes = [len(b) for b in batches]
    assert lines[0] == (
        f"Batches per epoch: {len(batches)} of {min(sizes)} to {max(sizes)} sequences (avg {np.mean(sizes):.1f})"
    )
    counted = 0
    for line in lines[1:]:
        lo, hi, count, share = re.fullmatch(
            r"Bucket \d+, longest sample \[(\d+),(\d+)\) tokens: (\d+) batches \(([\d.]+)%\)", line
        ).groups()
        in_bucket = [b for b in batches if int(lo) <= max(length_of[i] for i in b) < int(hi)]
        assert len(in_bucket) == int(count) and float(share) == round(100 * int(count) / len(batches), 1)
        counted += int(count)
    assert counted == len(batches)
    assert describe_plan([], {}) == ["Batches per epoch: 0"]
