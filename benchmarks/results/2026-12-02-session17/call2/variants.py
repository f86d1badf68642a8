"""Session 17 call 2: side by side in one process, the 27B drafter step (benchmarks/drafter.py's step: peer
batches, 16K tokens, 512 anchors) with the BlockMasks' mask function as the rule (masks.visible, session
16's code) and in the interval form this commit lands (masks.key_intervals).

    PYTHONPATH=. python benchmarks/results/2026-12-02-session17/call2/variants.py --mode compiled|eager [--variants rule,intervals]

Call 2 ran this file's first form, whose own copy of the timing loop measured the peak memory over the
warm-up too; the loop is now benchmarks/drafter.py's (`timed_steps`, through ../variant_step.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import dflash_cache.drafter.masks as masks
from benchmarks.flex_configs import rule_mask_mod

sys.path.insert(0, str(Path(__file__).parents[1]))
from variant_step import time_variant  # noqa: E402

LIBRARY_BLOCK_MASK = masks.block_mask


def rule_block_mask(layout, window, tile=128, group=1):
    mask = LIBRARY_BLOCK_MASK(layout, window, tile, group)
    mask.mask_mod = rule_mask_mod(layout, window, group)
    return mask


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="rule,intervals")
    parser.add_argument("--mode", default="compiled", choices=["compiled", "eager"])
    args = parser.parse_args()
    for name in args.variants.split(","):
        masks.block_mask = rule_block_mask if name == "rule" else LIBRARY_BLOCK_MASK
        time_variant(name, args.mode)


if __name__ == "__main__":
    main()
