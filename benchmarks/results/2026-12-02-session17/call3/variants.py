"""Session 17 call 3: side by side in one process, the compiled 27B drafter step (benchmarks/drafter.py's
step: peer batches, 16K tokens, 512 anchors) as the library compiles it (intervals) and with Inductor's
coordinate-descent tuning of its generated kernels (coord).

    PYTHONPATH=. python benchmarks/results/2026-12-02-session17/call3/variants.py [--variants intervals,coord]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import torch._inductor.config
from benchmarks.drafter import peer_batches, random_drafter, step_flops, train_step
from dflash_cache.drafter.anchors import sample_anchors
from dflash_cache.drafter.config import load_drafter_config
from dflash_cache.drafter.runner import DrafterRunner

def step_variant(name: str, args, config) -> None:
    torch._dynamo.reset()
    torch._inductor.config.coordinate_descent_tuning = name == "coord"
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
    parser.add_argument("--variants", default="intervals,coord")
    parser.add_argument("--mode", default="compiled", choices=["compiled", "eager"])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    config = load_drafter_config("qwen3.6-27b")
    for name in args.variants.split(","):
        try:
            step_variant(name, args, config)
        except Exception as error:  # a variant Inductor refuses: say so and go on
            print(f"step {args.mode} {name:>9}: failed: {type(error).__name__}: {str(error)[:400]}", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
