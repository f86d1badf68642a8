import torch

from dflash_cache.drafter.anchors import anchor_candidates, sample_anchors
from tests.support.drafter import random_batch

LENGTHS = [23, 5, 40, 9, 3, 31]


def plain_candidates(batch, block):
    """A position is a candidate if its block fits and predicts a loss-masked token."""
    out = []
    cu = batch.cu_seqlens.tolist()
    for start, end in zip(cu[:-1], cu[1:]):
        for a in range(start, end):
            if a + block <= end and batch.loss_mask[a + 1 : a + block].any():
                out.append(a)
    return out


def test_candidates_follow_bounds_and_loss_mask():
    for seed, rate in [(0, 0.3), (1, 0.9), (2, 0.0)]:
        batch = random_batch(LENGTHS, seed=seed, mask_rate=rate)
        for block in (2, 4, 16):
            got = anchor_candidates(batch, block).nonzero().flatten().tolist()
            assert got == plain_candidates(batch, block)


def test_sampled_anchors_are_sorted_bounded_and_per_sequence():
    batch = random_batch(LENGTHS, seed=0)
    allowed = set(plain_candidates(batch, 4))
    seq = batch.sequence_ids()
    for max_anchors in (1, 3, 100):
        anchors = sample_anchors(batch, 4, max_anchors, torch.Generator().manual_seed(0))
        assert anchors.dtype == torch.int64
        assert torch.equal(anchors, anchors.sort().values) and len(set(anchors.tolist())) == len(anchors)
        assert set(anchors.tolist()) <= allowed
        per_sequence = torch.bincount(seq[anchors], minlength=len(LENGTHS))
        available = torch.bincount(seq[torch.tensor(sorted(allowed))], minlength=len(LENGTHS))
        assert torch.equal(per_sequence, available.clamp(max=max_anchors))
    assert set(sample_anchors(batch, 4, 100).tolist()) == allowed  # room for all: every candidate


def test_sampling_is_deterministic_and_uniform():
    batch = random_batch([40], seed=1)
    draw = lambda seed: sample_anchors(batch, 4, 3, torch.Generator().manual_seed(seed))  # noqa: E731
    assert torch.equal(draw(7), draw(7))
    assert not all(torch.equal(draw(7), draw(s)) for s in range(8, 12))
    allowed = plain_candidates(batch, 4)
    counts = torch.bincount(torch.cat([draw(s) for s in range(400)]), minlength=40)[allowed].float()
    expected = 400 * 3 / len(allowed)
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 2.5 * (len(allowed) - 1)  # about 36 when uniform; picking favourites gives thousands


def test_max_total_keeps_a_sorted_subset():
    batch = random_batch(LENGTHS, seed=0)
    everything = sample_anchors(batch, 4, 5, torch.Generator().manual_seed(0))
    capped = sample_anchors(batch, 4, 5, torch.Generator().manual_seed(0), max_total=7)
    assert len(everything) > 7 and len(capped) == 7
    assert set(capped.tolist()) <= set(everything.tolist())
    assert torch.equal(capped, capped.sort().values)


def test_no_candidates_gives_no_anchors():
    batch = random_batch([10, 3], seed=0, mask_rate=1.0)  # nothing loss-masked
    assert sample_anchors(batch, 4, 8, torch.Generator().manual_seed(0)).numel() == 0
