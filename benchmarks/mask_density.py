"""How much of the drafter's flex-attention work is useful: the BlockMask's tiles against the pairs it must see.

    PYTHONPATH=. python benchmarks/mask_density.py [--preset qwen3.6-27b] [--tokens 16384] [--anchors 512] [--tiles 128,64]

On the peer's two batches (benchmarks/drafter.py `peer_batches`), for each layer type and tile size:
the tiles flex-attention computes (partial tiles run the mask function, full tiles skip it), the
(query, key) pairs those tiles hold, the pairs the attention rule lets through (counted on the dense
mask, `drafter/masks.py` `dense_mask`), and their ratio. Runs on the CPU: it builds masks only.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.drafter import add_step_shape_arguments, peer_batches
from dflash_cache.drafter.anchors import sample_anchors
from dflash_cache.drafter.config import load_drafter_config
from dflash_cache.drafter.inputs import DraftInputs
from dflash_cache.drafter.masks import BlockLayout, block_mask, dense_mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_shape_arguments(parser)
    parser.add_argument("--tiles", default="128,64")
    args = parser.parse_args()
    config = load_drafter_config(args.preset)
    batches = peer_batches(config, args.tokens, "cpu")
    g = torch.Generator().manual_seed(0)  # benchmarks/drafter.py's draw on the CPU (a CUDA generator draws others)
    anchors = [sample_anchors(b, config.block_size, args.anchors, g, max_total=args.anchors) for b in batches]
    windows = {"full_attention": None, "sliding_attention": config.sliding_window}
    print(f"{'batch':>5} {'layers':>17} {'tile':>4} {'partial':>8} {'full':>6} {'computed pairs':>15} "
          f"{'useful pairs':>13} {'useful share':>12}")
    for tile in map(int, args.tiles.split(",")):
        for k, (batch, a) in enumerate(zip(batches, anchors)):
            inputs = DraftInputs.build(batch, a)
            layout = BlockLayout.build(inputs.seq_ids, inputs.positions, inputs.anchors, config.block_size, tile)
            for kind in dict.fromkeys(config.layer_types):
                mask = block_mask(layout, windows[kind], tile)
                partial, full = int(mask.kv_num_blocks.sum()), int(mask.full_kv_num_blocks.sum())
                computed = (partial + full) * tile * tile
                useful = int(dense_mask(layout, windows[kind]).sum())
                print(f"{k:>5} {kind:>17} {tile:>4} {partial:>8,} {full:>6,} {computed:>15,} {useful:>13,} "
                      f"{useful / computed:>12.3f}", flush=True)


if __name__ == "__main__":
    main()
