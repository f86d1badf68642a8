"""Session 13: the interval mask function of variants.py (imask) against the dense rule, on the CPU.

    PYTHONPATH=. python benchmarks/results/2026-12-02-session13/call2/check_imask.py

200 random packed layouts (block sizes 4 and 16; tiles 8, 16 and 128; windows none, 3, 7 and 2048): the
mask function equals masks.dense_mask on every real (query, key) pair, padding queries see nothing, and
on every 10th layout flex-attention with it equals the reference attention on rows that see a key.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import variants as V
from dflash_cache.drafter import masks
torch.manual_seed(0)
for trial in range(200):
    lens = torch.randint(1, 60, (int(torch.randint(1, 5, (1,))),))
    n = int(lens.sum())
    seq = torch.repeat_interleave(torch.arange(len(lens)), lens)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(n) - torch.repeat_interleave(starts, lens)
    a = int(torch.randint(1, 20, (1,)))
    anchors = torch.sort(torch.randint(0, n, (a,))).values
    b = [4, 16][trial % 2]
    tile = [8, 16, 128][trial % 3]
    layout = masks.BlockLayout.build(seq, pos, anchors, b, tile)
    for window in [None, 3, 7, 2048]:
        bm = V.interval_block_mask(layout, window, tile)
        q = torch.arange(layout.num_queries)[:, None]; kv = torch.arange(layout.num_keys)[None, :]
        got = bm.mask_mod(0, 0, q, kv)
        want = masks.dense_mask(layout, window)
        assert torch.equal(got, want), (trial, window)
        # padding queries see nothing
        qp = torch.arange(layout.num_queries, layout.q_seq.shape[0])[:, None]
        kvp = torch.arange(layout.kv_seq.shape[0])[None, :]
        assert not bm.mask_mod(0, 0, qp, kvp).any()
        # flex forward equals reference
        if trial % 10 == 0:
            from dflash_cache.drafter.attention import attend, reference_attention
            Q = layout.num_queries; K = layout.num_keys
            qq = torch.randn(1, 4, Q, 8); kk = torch.randn(1, 2, K, 8); vv = torch.randn(1, 2, K, 8)
            with torch.no_grad():
                o1 = attend(qq, kk, vv, bm); o2 = reference_attention(qq, kk, vv, want)
            rows = want.any(1)
            assert torch.allclose(o1[:, :, rows], o2[:, :, rows], atol=1e-5), (trial, window)
print("ok")
