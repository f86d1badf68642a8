"""Session 17 call 1: side by side in one process, the compiled 27B drafter step (benchmarks/drafter.py's
step: peer batches, 16K tokens, 512 anchors) with and without each candidate change to the attention.

    PYTHONPATH=. python benchmarks/results/2026-12-02-session17/call1/variants.py [--variants base,intervals,tma]

Variants (cumulative, in this order):
  base       the mask function as the rule (masks.visible), session 16's code
  intervals  + the mask function as each query's two key intervals, precomputed into one tensor
             (`precomputed_interval_mask_mod`, this file)
  tma        + flex-attention's USE_TMA kernel option (forward and backward)

Call 1 ran this file's first form at commit 08fdd76, where benchmarks/flex_configs.py held the
precomputed intervals and the library's mask function was the rule; both variants that used the
intervals failed in Inductor (variants.log). The interval form since landed (masks.key_intervals,
evaluated inside the mask function) is measured by call 2's script.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import dflash_cache.drafter.attention as attention
import dflash_cache.drafter.masks as masks
from benchmarks.flex_configs import rule_mask_mod

sys.path.insert(0, str(Path(__file__).parents[1]))
from variant_step import time_variant  # noqa: E402

LIBRARY_BLOCK_MASK = masks.block_mask
LIBRARY_OPTIONS = dict(attention.KERNEL_OPTIONS)


def precomputed_interval_mask_mod(layout, window, group):
    """The tried form: the intervals of every query computed into one tensor, which the mask function
    indexes."""
    q = layout.num_queries
    bounds = torch.zeros(4, layout.q_seq.shape[0], dtype=torch.int64, device=layout.q_seq.device)
    bounds[:, :q] = torch.stack(masks.key_intervals(layout, torch.arange(q, device=bounds.device), window))
    ctx_lo, ctx_hi, blk_lo, blk_hi = bounds

    def mask_mod(b, h, q_idx, kv_idx):
        r = q_idx // group
        return ((kv_idx >= ctx_lo[r]) & (kv_idx < ctx_hi[r])) | ((kv_idx >= blk_lo[r]) & (kv_idx < blk_hi[r]))
    return mask_mod


def variant_block_mask(intervals: bool):
    def build(layout, window, tile=128, group=1):
        mask = LIBRARY_BLOCK_MASK(layout, window, tile, group)
        mask.mask_mod = (precomputed_interval_mask_mod if intervals else rule_mask_mod)(layout, window, group)
        return mask
    return build


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="base,intervals,tma")
    args = parser.parse_args()
    order = ["base", "intervals", "tma"]
    for name in args.variants.split(","):
        active = set(order[1: order.index(name) + 1])
        masks.block_mask = variant_block_mask("intervals" in active)
        attention.KERNEL_OPTIONS = dict(LIBRARY_OPTIONS, USE_TMA=True) if "tma" in active else dict(LIBRARY_OPTIONS)
        time_variant(name, "compiled")


if __name__ == "__main__":
    main()
