"""How much of the drafter's flex-attention work is useful: the BlockMask's tiles against the pairs it must see.

    PYTHONPATH=. python benchmarks/mask_density.py [--preset qwen3.6-27b] [--tokens 16384] [--anchors 512] [--tiles 128,64]
                                                   [--groups 1,4]

On the two batches of speculators 0.9.0's step script (benchmarks/drafter.py `peer_batches`), for each layer type and tile size:
the tiles flex-attention computes (partial tiles run the mask function, full tiles skip it), the
(query, key) pairs those tiles hold, the pairs the attention rule lets through (counted on the dense
mask, `drafter/masks.py` `dense_mask`), and their ratio, over all query heads. --groups: rows per query
(1: each query head runs its own mask; the query heads of a key head, as the drafter packs them:
`block_mask`'s `group`). Runs on the CPU: it builds masks only.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from benchmarks.drafter import add_step_shape_arguments, peer_batches
from dflash_cache.drafter.anchors import sample_anchors
from dflash_cache.drafter.config_file import load_drafter_config
from dflash_cache.drafter.inputs import DraftInputs
from dflash_cache.drafter.masks import BlockLayout, block_mask, dense_mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_shape_arguments(parser)
    parser.add_argument("--tiles", default="128,64")
    parser.add_argument(
        "--groups",
        default=None,
        help="comma-separated rows per query (default: 1 and the preset's query heads per key head)",
    )
    args = parser.parse_args()
    config = load_drafter_config(args.preset)
    batches = peer_batches(config, args.tokens, "cpu")
    g = torch.Generator().manual_seed(0)  # benchmarks/drafter.py's draw on the CPU (a CUDA generator draws others)
    anchors = [sample_anchors(b, config.block_size, args.anchors, g, max_total=args.anchors) for b in batches]
    windows = {"full_attention": None, "sliding_attention": config.sliding_window}
    heads = config.num_attention_heads
    groups = args.groups or f"1,{heads // config.num_key_value_heads}"
    print(
        f"{'batch':>5} {'layers':>17} {'tile':>4} {'group':>5} {'partial':>8} {'full':>6} {'computed pairs':>15} "
        f"{'useful pairs':>13} {'useful share':>12}"
    )
    for tile, group in itertools.product(map(int, args.tiles.split(",")), map(int, groups.split(","))):
        for k, (batch, a) in enumerate(zip(batches, anchors)):
            inputs = DraftInputs.build(batch, a)
            layout = BlockLayout.build(inputs.seq_ids, inputs.positions, inputs.anchors, config.block_size, tile)
            for kind in dict.fromkeys(config.layer_types):
                mask = block_mask(layout, windows[kind], tile, group)
                masks = heads // group  # one mask per key head when packed, per query head otherwise
                partial, full = int(mask.kv_num_blocks.sum()) * masks, int(mask.full_kv_num_blocks.sum()) * masks
                computed = (partial + full) * tile * tile
                useful = int(dense_mask(layout, windows[kind]).sum()) * heads
                print(
                    f"{k:>5} {kind:>17} {tile:>4} {group:>5} {partial:>8,} {full:>6,} {computed:>15,} {useful:>13,} "
                    f"{useful / computed:>12.3f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
