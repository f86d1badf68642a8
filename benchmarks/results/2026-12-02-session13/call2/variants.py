"""Session 13 call 2: candidate changes to the compiled drafter step, one process each, timed alone.

    PYTHONPATH=. python benchmarks/results/2026-12-02-session13/call2/variants.py VARIANT[+VARIANT...]

Each variant patches the landed code (75b4c3c) for this process only:
  imask   flex-attention's mask function from the per-query key intervals the tile lists come from
          (4 per-query loads, no per-key ones) instead of the sequence/block/position rule
  align   the compiled drafter's context padded so that the block keys start on a tile boundary
  kvcat   each layer's k and v projections over cat(context, block) in one matmul each
  chunk2x the LM-head loss in chunks of twice the rows
"""

import argparse
import json
import sys

import torch

import benchmarks.drafter as bench
from dflash_cache.drafter import head_loss, masks, model
from dflash_cache.drafter.config import load_drafter_config
from dflash_cache.drafter.inputs import DraftInputs
from torch.nn.attention.flex_attention import BlockMask


def interval_block_mask(layout, window, tile=128):
    landed = original_block_mask(layout, window, tile)
    ctx_lo, ctx_hi, blk_lo, blk_hi = masks._key_intervals(layout, window)
    real = layout.q_seq >= 0
    ctx_hi = torch.where(real, ctx_hi, ctx_lo)
    blk_hi = torch.where(real, blk_hi, blk_lo)

    def mask_mod(b, h, q_idx, kv_idx):
        return ((kv_idx >= ctx_lo[q_idx]) & (kv_idx < ctx_hi[q_idx])) | ((kv_idx >= blk_lo[q_idx]) & (kv_idx < blk_hi[q_idx]))

    return BlockMask.from_kv_blocks(landed.kv_num_blocks, landed.kv_indices, landed.full_kv_num_blocks,
                                    landed.full_kv_indices, BLOCK_SIZE=tile, mask_mod=mask_mod,
                                    seq_lengths=landed.seq_lengths)


def aligned_padded(self, token_budget, anchor_budget, block_size):
    total = -(-(token_budget + block_size) // 128) * 128
    return original_padded(self, total - block_size, anchor_budget, block_size)


def kvcat_forward(self, x, context, rope_q, rope_kv, mask):
    heads = lambda t: t.unflatten(-1, (-1, self.head_dim))  # noqa: E731
    both = torch.cat([context, x])
    q = self.q_norm(heads(self.q_proj(x)))
    k = self.k_norm(heads(self.k_proj(both)))
    v = heads(self.v_proj(both))
    q, k = model.rotate(q, rope_q), model.rotate(k, rope_kv)
    as_batch = lambda t: t.transpose(0, 1)[None].contiguous()  # noqa: E731
    out = model.attend(as_batch(q), as_batch(k), as_batch(v), mask)
    return self.o_proj(out[0].transpose(0, 1).flatten(1))


original_block_mask, original_padded = masks.block_mask, DraftInputs.padded
PATCHES = {
    "base": lambda: None,
    "imask": lambda: setattr(masks, "block_mask", interval_block_mask),
    "align": lambda: setattr(DraftInputs, "padded", aligned_padded),
    "kvcat": lambda: setattr(model.Attention, "forward", kvcat_forward),
    "chunk2x": lambda: setattr(head_loss, "LOGITS_PER_CHUNK", head_loss.LOGITS_PER_CHUNK * 2),
}

if __name__ == "__main__":
    variant, mode = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "compiled")
    for name in variant.split("+"):
        PATCHES[name]()
    args = argparse.Namespace(tile=128, tokens=16384, anchors=512, compile_mode=None, warmup=3, steps=10,
                              profile=None, peak_tflops=790.0)
    result = bench.run_mode(mode, args, load_drafter_config("qwen3.6-27b"), "cuda")
    print(json.dumps({"variant": variant, **result}))
    print(f"RESULT {variant:>14} {mode}: {result['step_ms']:.1f} ms (median {result['step_ms_median']:.1f})  "
          f"{result['tokens_per_s']:,.0f} tok/s  MFU {result['mfu']:.1%}  warm-up {result['warmup_s']:.0f} s  "
          f"loss {result['loss_first']:.4f} -> {result['loss_last']:.4f}", flush=True)
