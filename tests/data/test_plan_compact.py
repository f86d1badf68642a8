"""The compact plans (data/plan.py's Batches) are the plans the list-of-lists code made: the old
row packing and padded bucketing, kept here as the reference, on thousands of realistic lengths."""

import bisect

import numpy as np
import pytest

from dflash_cache.data.plan import Batches, length_buckets, plan_batches, shard_for_rank
from dflash_cache.extract.buckets import BucketLayout
from dflash_cache.extract.packing import plan_rows


def old_plan_rows(sample_ids, lengths, row_tokens):
    by_length = {}
    for sid, n in sorted(zip(sample_ids, lengths), key=lambda p: (p[1], -p[0])):
        by_length.setdefault(n, []).append(sid)
    sizes = sorted(by_length)
    rows = []
    while sizes:
        row, room = [], row_tokens
        while (i := bisect.bisect_right(sizes, room) - 1) >= 0:
            n = sizes[i]
            row.append(by_length[n].pop())
            room -= n
            if not by_length[n]:
                del sizes[i]
        rows.append(row)
    return rows


def old_bucket_plan(layout, sample_ids, lengths):
    bounds = length_buckets(layout.max_length)
    buckets = {}
    for sid, n in zip(sample_ids, lengths):
        buckets.setdefault(bounds[bisect.bisect_right(bounds, n)], []).append((n, sid))
    batches = []
    for upper in sorted(buckets, reverse=True):
        size = max(1, layout.token_budget // (-(-(upper - 1) // 8) * 8))  # rows of a bucket: T rounded up to 8
        members = [sid for _, sid in sorted(buckets[upper])]
        batches += [members[i : i + size] for i in range(0, len(members), size)]
    return batches


def data(n, seed):
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(np.log(2600), 0.6, n)), 1, 8192).astype(int)
    lengths[: n // 10] = rng.integers(1, 40, n // 10)  # many equal lengths: ties broken by id
    ids = rng.permutation(3 * n)[:n]  # ids with gaps, in no order
    return ids.tolist(), lengths.tolist()


@pytest.mark.parametrize("seed", [0, 1])
def test_compact_plans_equal_the_old_lists(seed):
    ids, lengths = data(4000, seed)
    for row_tokens in (8192, 49152):
        assert list(plan_rows(ids, lengths, row_tokens)) == old_plan_rows(ids, lengths, row_tokens)
    for layout in (BucketLayout(49152, 8192), BucketLayout(10000, 8192)):
        assert list(layout.plan(ids, lengths)) == old_bucket_plan(layout, ids, lengths)
    # numpy inputs (what extract passes) give the same plan as lists
    assert plan_rows(np.array(ids), np.array(lengths), 49152) == plan_rows(ids, lengths, 49152)


def test_batches_is_a_sequence_of_lists_and_shares_by_rank():
    lists = [[5, 1], [7], [2, 9, 4], [3]]
    batches = Batches.from_lists(lists)
    assert len(batches) == 4 and batches[2] == [2, 9, 4] and batches[-1] == [3]
    assert batches == lists and list(batches) == lists and batches != [[5, 1]]
    assert batches[1::2] == [[7], [3]]
    assert shard_for_rank(batches, 1, 3, drop_remainder=False) == [[7]]
    assert shard_for_rank(batches, 0, 3, drop_remainder=False) == [[5, 1], [3]]
    with pytest.raises(IndexError):
        batches[4]
    assert Batches.from_lists([]) == [] and len(Batches.from_lists([])) == 0


def old_plan_batches(sample_ids, lengths, token_budget, seed, epoch=0):
    ids, lens = np.asarray(sample_ids, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    bounds = length_buckets(int(lens.max()))
    bucket = np.searchsorted(bounds, lens, side="right") - 1
    rng = np.random.default_rng([seed, epoch]) if seed is not None else None
    batches = []
    for k in np.unique(bucket)[::-1] if rng is None else np.unique(bucket):
        members = np.flatnonzero(bucket == k)
        members = (
            members[np.lexsort((ids[members], lens[members]))]
            if rng is None
            else members[rng.permutation(len(members))]
        )
        batch, tokens = [], 0
        for sid, n in zip(ids[members].tolist(), lens[members].tolist()):
            if batch and tokens + n > token_budget:
                batches.append(batch)
                batch, tokens = [], 0
            batch.append(sid)
            tokens += n
        batches.append(batch)
    return batches if rng is None else [batches[i] for i in rng.permutation(len(batches))]


@pytest.mark.parametrize("seed", [None, 0, 5])
def test_training_plans_equal_the_old_lists(seed):
    ids, lengths = data(4000, 3)
    for budget, epoch in ((16384, 0), (16384, 2), (3000, 1)):
        assert list(plan_batches(ids, lengths, budget, seed, epoch)) == old_plan_batches(
            ids, lengths, budget, seed, epoch
        )
