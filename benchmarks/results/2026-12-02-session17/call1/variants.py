"""Session 17 call 1: side by side in one process, the compiled 27B drafter step (benchmarks/drafter.py's
step: peer batches, 16K tokens, 512 anchors) with and without each candidate change to the attention.

    PYTHONPATH=. python benchmarks/results/2026-12-02-session17/call1/variants.py [--variants base,intervals,tma]

Variants (cumulative, in this order):
  base       the library's code (masks.visible as the BlockMask's mask function)
  intervals  + the mask function as each query's two key intervals (benchmarks/flex_configs.py
             interval_mask_mod): no per-key loads in the kernels' partial tiles
  tma        + flex-attention's USE_TMA kernel option (forward and backward)

It ran at commit 08fdd76, whose benchmarks/flex_configs.py held interval_mask_mod (the intervals precomputed
into one tensor); both variants that used it failed in Inductor (variants.log). The landed interval form
(masks.key_intervals, evaluated inside the mask function) is measured by call 2's script.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import dflash_cache.drafter.attention as attention
import dflash_cache.drafter.masks as masks
from benchmarks.drafter import peer_batches, random_drafter, step_flops, train_step
from benchmarks.flex_configs import interval_mask_mod
from dflash_cache.drafter.anchors import sample_anchors
from dflash_cache.drafter.config import load_drafter_config
from dflash_cache.drafter.runner import DrafterRunner

LIBRARY_BLOCK_MASK = masks.block_mask
LIBRARY_OPTIONS = dict(attention.KERNEL_OPTIONS)


def interval_block_mask(layout, window, tile=128, group=1):
    mask = LIBRARY_BLOCK_MASK(layout, window, tile, group)
    mask.mask_mod = interval_mask_mod(layout, window, group)
    return mask


def step_variant(name: str, active: set[str], args, config) -> None:
    torch._dynamo.reset()
    masks.block_mask = interval_block_mask if "intervals" in active else LIBRARY_BLOCK_MASK
    attention.KERNEL_OPTIONS = dict(LIBRARY_OPTIONS, USE_TMA=True) if "tma" in active else dict(LIBRARY_OPTIONS)
    model, optimizer = random_drafter(config, "cuda")
    runner = DrafterRunner(model, compiled=args.mode == "compiled", token_budget=args.tokens, anchor_budget=args.anchors)
    batches = peer_batches(config, args.tokens, "cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    anchors = [sample_anchors(b, config.block_size, args.anchors, g, max_total=args.anchors) for b in batches]
    started = time.perf_counter()
    losses = []
    for k in range(args.warmup):
        losses.append(train_step(runner, model, optimizer, batches[k % 2], anchors[k % 2], "cuda"))
    torch.cuda.synchronize()
    warm = time.perf_counter() - started
    times = []
    for k in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(train_step(runner, model, optimizer, batches[k % 2], anchors[k % 2], "cuda"))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step_s = statistics.mean(times)
    flops = statistics.mean(step_flops(config, batches[k % 2], anchors[k % 2]) for k in range(2))
    print(f"step {args.mode} {name:>9}: {step_s * 1e3:.1f} ms (median {statistics.median(times) * 1e3:.1f})  "
          f"MFU {flops / step_s / 790e12:.1%}  warm-up {warm:.0f} s  peak {torch.cuda.max_memory_allocated() / 1e9:.1f} GB  "
          f"losses {' '.join(f'{l.item():.4f}' for l in losses[:6])}", flush=True)
    del model, optimizer, runner
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="base,intervals,tma")
    parser.add_argument("--mode", default="compiled", choices=["compiled", "eager"])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    config = load_drafter_config("qwen3.6-27b")
    order = ["base", "intervals", "tma"]
    for name in args.variants.split(","):
        try:
            step_variant(name, set(order[1: order.index(name) + 1]), args, config)
        except Exception as error:  # a variant Inductor refuses: say so and go on
            print(f"step {args.mode} {name:>9}: failed: {type(error).__name__}: {str(error)[:400]}", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
