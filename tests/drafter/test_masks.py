import pytest
import torch

from dflash_cache.drafter.anchors import sample_anchors
from dflash_cache.drafter.attention import attend, pack_heads, reference_attention
from dflash_cache.drafter.masks import BatchMasks, BlockLayout, block_mask, dense_mask
from tests.support.drafter import random_batch

BLOCK = 4
CASES = [  # (sequence lengths, seed)
    ([23, 5, 40, 9], 0),
    ([64], 1),
    ([7, 7, 30, 4, 19, 11], 2),
]
WINDOWS = [None, 6, 3]  # 3 < block size: the window cuts the block itself


def layout_for(lengths, seed, max_anchors=4, tile=16):
    batch = random_batch(lengths, seed=seed)
    anchors = sample_anchors(batch, BLOCK, max_anchors, torch.Generator().manual_seed(seed))
    layout = BlockLayout.build(batch.sequence_ids(), batch.position_ids(), anchors, BLOCK, tile)
    return batch, anchors, layout


def expected_mask(batch, anchors, window):
    """The rule written out plainly, one query at a time."""
    n, seq, pos = batch.num_tokens, batch.sequence_ids().tolist(), batch.position_ids().tolist()
    mask = torch.zeros(len(anchors) * BLOCK, n + len(anchors) * BLOCK, dtype=torch.bool)
    for j, a in enumerate(anchors.tolist()):
        for i in range(BLOCK):
            row, q_pos = j * BLOCK + i, pos[a] + i
            for t in range(a):
                if seq[t] == seq[a] and (window is None or q_pos - pos[t] < window):
                    mask[row, t] = True
            for i2 in range(BLOCK):
                if window is None or (i2 <= i and i - i2 < window):
                    mask[row, n + j * BLOCK + i2] = True
    return mask


def tiles_of(count, indices, shape):
    dense = torch.zeros(shape, dtype=torch.bool)
    for row in range(shape[0]):
        dense[row, indices[0, 0, row, : count[0, 0, row]].long()] = True
    return dense


@pytest.mark.parametrize("lengths,seed", CASES)
@pytest.mark.parametrize("window", WINDOWS)
def test_dense_mask_follows_the_rule(lengths, seed, window):
    batch, anchors, layout = layout_for(lengths, seed)
    assert len(anchors) > len(lengths)  # several anchors per sequence
    assert torch.equal(dense_mask(layout, window), expected_mask(batch, anchors, window))


@pytest.mark.parametrize("lengths,seed", CASES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("tile,group", [(16, 1), (32, 1), (16, 4), (32, 2)])
def test_block_mask_tiles_are_exact(lengths, seed, window, tile, group):
    """Listed tiles are exactly those with a visible pair; 'full' tiles are entirely visible. With
    `group` rows per query, the rule holds row by row."""
    batch, anchors, layout = layout_for(lengths, seed, tile=tile)
    dense = expected_mask(batch, anchors, window).repeat_interleave(group, dim=0)
    q, kv = dense.shape
    rows, cols = -(-q // tile), -(-kv // tile)
    padded = torch.zeros(rows * tile, cols * tile, dtype=torch.bool)
    padded[:q, :kv] = dense
    exists = torch.zeros_like(padded)
    exists[:q, :kv] = True
    per_tile = lambda m: m.view(rows, tile, cols, tile).sum((1, 3))  # noqa: E731
    visible, present = per_tile(padded), per_tile(exists)

    mask = block_mask(layout, window, tile, group)
    assert mask.seq_lengths == (q, kv)
    partial = tiles_of(mask.kv_num_blocks, mask.kv_indices, (rows, cols))
    full = tiles_of(mask.full_kv_num_blocks, mask.full_kv_indices, (rows, cols))
    assert not (partial & full).any()
    assert torch.equal(partial | full, visible > 0)
    assert torch.equal(full & (visible != present), torch.zeros_like(full))
    context_cols = torch.arange(cols) * tile + tile <= batch.num_tokens
    assert torch.equal(full, (visible == present) & (visible > 0) & context_cols[None, :])
    rows_seen = mask.mask_mod(0, 0, torch.arange(q)[:, None], torch.arange(kv)[None, :])
    assert torch.equal(rows_seen, dense)
    padding_rows = mask.mask_mod(0, 0, torch.arange(q, rows * tile)[:, None], torch.arange(cols * tile)[None, :])
    assert not padding_rows.any()  # the kernels evaluate a last partial tile's padding rows too


def random_qkv(q_len, kv_len, seed, heads=4, kv_heads=2, dim=8):
    """q [Q, heads, D], k and v [KV, kv_heads, D]."""
    g = torch.Generator().manual_seed(seed)
    make = lambda h, t: torch.randn(t, h, dim, generator=g)  # noqa: E731
    return make(heads, q_len), make(kv_heads, kv_len), make(kv_heads, kv_len)


@pytest.mark.parametrize("lengths,seed", [CASES[0], CASES[2]])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1), (2, 2)])
def test_flex_attention_equals_dense_reference(lengths, seed, heads, kv_heads):
    """Query heads packed per key head (attend with a grouped BlockMask) against the reference, which
    repeats each key head for its query heads."""
    _, _, layout = layout_for(lengths, seed)
    group = heads // kv_heads
    masks = BatchMasks.build(layout, ["sliding_attention", "full_attention"], sliding_window=6, tile=16, group=group)
    for kind, window in [("sliding_attention", 6), ("full_attention", None)]:
        q, k, v = random_qkv(layout.num_queries, layout.num_keys, seed, heads, kv_heads)
        as_batch = lambda t: t.transpose(0, 1)[None]  # noqa: E731
        expected = reference_attention(as_batch(q), as_batch(k), as_batch(v), dense_mask(layout, window))
        got = attend(*(pack_heads(t, kv_heads) for t in (q, k, v)), masks.by_type[kind], group)
        torch.testing.assert_close(got, expected[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
