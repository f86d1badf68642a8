"""Session 17: one variant of the 27B drafter step timed as benchmarks/drafter.py times it (its peer
batches, 16K tokens, 512 anchors), printed as one line; shared by the calls' variants scripts."""

from __future__ import annotations

import statistics

import torch

from benchmarks.drafter import drafter_step, step_flops, timed_steps
from dflash_cache.drafter.config import load_drafter_config


def time_variant(name: str, mode: str, tokens: int = 16384, anchors: int = 512, warmup: int = 4, steps: int = 10) -> None:
    torch._dynamo.reset()
    config = load_drafter_config("qwen3.6-27b")
    try:
        step, model, batches, chosen = drafter_step(config, "cuda", mode, tokens, anchors)
        warm, times, losses = timed_steps(step, warmup, steps, "cuda")
    except Exception as error:  # a variant Inductor refuses: say so and go on
        print(f"step {mode} {name:>9}: failed: {type(error).__name__}: {str(error)[:400]}", flush=True)
        return
    step_s = statistics.mean(times)
    flops = statistics.mean(step_flops(config, batches[k % 2], chosen[k % 2]) for k in range(2))
    print(f"step {mode} {name:>9}: {step_s * 1e3:.1f} ms (median {statistics.median(times) * 1e3:.1f})  "
          f"MFU {flops / step_s / 790e12:.1%}  warm-up {warm:.0f} s  peak {torch.cuda.max_memory_allocated() / 1e9:.1f} GB  "
          f"losses {' '.join(f'{l.item():.4f}' for l in losses[:6])}", flush=True)
    del step, model
    torch.cuda.empty_cache()
