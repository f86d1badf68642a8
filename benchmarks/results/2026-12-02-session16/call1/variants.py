"""Session 16 call 1: side by side in one process, the compiled 27B drafter step (benchmarks/drafter.py's
step: peer batches, 16K tokens, 512 anchors) with and without each candidate change, and the loss
kernel's row statistics alone.

    PYTHONPATH=. python benchmarks/results/2026-12-02-session16/call1/variants.py [--variants base,rope,stats,bf16]

Variants (cumulative, in this order):
  base   session 15's code: rotary cos/sin computed inline, the head loss's row statistics reduced per block
  rope   + rotary tables as an opaque op (drafter/model.py rotary_tables)
  stats  + per-lane row statistics (drafter/head_kernel.py _row_stats)
  bf16   + bf16 working weights with fp32 masters in the optimizer (a prototype here)

Call 1 ran this file's first form, with the two tried changes in the library's working tree (model.py
`rotary_tables`, head_kernel.py's per-lane `_row_stats`). Neither was landed, so they now live here, and
the library's own code is the base.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import triton
import triton.language as tl

import dflash_cache.drafter.head_kernel as head_kernel
import dflash_cache.drafter.model as model_module
from benchmarks.drafter import peer_batches, random_drafter, step_flops, train_step
from dflash_cache.drafter.anchors import sample_anchors
from dflash_cache.drafter.config import load_drafter_config
from dflash_cache.drafter.runner import DrafterRunner
from dflash_cache.train.optim import CompiledAdamW


@triton.jit
def lane_row_stats(logits, labels, stride, vocab, nll, argmax, BLOCK: tl.constexpr):  # tried in session 16
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    lane_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    lane_sum = tl.zeros((BLOCK,), tl.float32)
    lane_index = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, x)
        seen = new_max > float("-inf")
        lane_sum = tl.where(seen, lane_sum * tl.exp(lane_max - new_max) + tl.exp(x - new_max), 0.0)
        lane_index = tl.where(x > lane_max, cols, lane_index)
        lane_max = new_max
    row_max = tl.max(lane_max, 0)
    total = tl.sum(tl.where(lane_max > float("-inf"), lane_sum * tl.exp(lane_max - row_max), 0.0), 0)
    best_index = tl.min(tl.where(lane_max == row_max, lane_index, vocab), 0)
    lse = row_max + tl.log(total)
    target = tl.load(base + tl.load(labels + row)).to(tl.float32)
    tl.store(nll + row, lse - target)
    tl.store(argmax + row, best_index.to(tl.int64))


@torch.library.custom_op("session16::rotary_tables", mutates_args=())
def rotary_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, 1, D]: opaque to Inductor, so computed once a step (tried in session 16)."""
    angles = positions.float()[:, None] * inv_freq.float()[None, :]
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


@rotary_tables.register_fake
def _(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (positions.shape[0], 1, 2 * inv_freq.shape[0])
    return positions.new_empty(shape, dtype=dtype), positions.new_empty(shape, dtype=dtype)


LIBRARY_ROW_STATS = head_kernel._row_stats
LIBRARY_ROTARY = model_module.Rotary.forward


def table_rotary(self, positions, dtype):
    return rotary_tables(positions, self.inv_freq, dtype)


def time_gpu(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    e = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    e[0].record()
    for _ in range(iters):
        fn()
    e[1].record()
    torch.cuda.synchronize()
    return e[0].elapsed_time(e[1]) / iters


def row_stats_alone() -> None:
    rows, vocab = 1024, 248320
    g = torch.Generator("cuda").manual_seed(0)
    logits = (torch.randn(rows, vocab, device="cuda", generator=g) * 3).bfloat16()
    labels = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    ref = logits.float()
    ref_nll = torch.logsumexp(ref, -1) - ref.gather(1, labels[:, None])[:, 0]
    ref_arg = ref.argmax(-1)
    for name, kernel, block, warps in [("old", LIBRARY_ROW_STATS, 4096, 4), ("new", lane_row_stats, 4096, 8),
                                       ("new", lane_row_stats, 4096, 16), ("new", lane_row_stats, 2048, 4),
                                       ("new", lane_row_stats, 2048, 8), ("new", lane_row_stats, 8192, 16)]:
        nll = torch.empty(rows, device="cuda")
        arg = torch.empty(rows, dtype=torch.int64, device="cuda")
        run = lambda: kernel[(rows,)](logits, labels, logits.stride(0), vocab, nll, arg, BLOCK=block, num_warps=warps)  # noqa: E731
        ms = time_gpu(run)
        print(f"row stats {name} BLOCK {block} warps {warps}: {ms * 1e3:.1f} us for {rows} x {vocab} bf16 "
              f"({rows * vocab * 2 / ms / 1e9:.2f} TB/s); nll max diff {(nll - ref_nll).abs().max().item():.2e}, "
              f"argmax equal {torch.equal(arg, ref_arg)}", flush=True)


class MasterAdamW(CompiledAdamW):
    """Prototype: every parameter bf16 (norms too), fp32 masters and moments in the optimizer state. Call 1
    ran its own copy of the update, since landed as train/optim.py adamw_update's `masters`."""

    def __init__(self, model, groups, **kw):
        super().__init__(groups, **kw)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["master"] = p.detach().clone()
                state["step"] = torch.zeros((), device=p.device)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
        for p in model.parameters():
            p.data = p.data.bfloat16()

    @torch.no_grad()
    def step(self, closure=None, grad_divisor=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            states = [self.state[p] for p in params]
            lr, divisor = self._scalar_tensors(params[0].device, group["lr"], grad_divisor)
            beta1, beta2 = group["betas"]
            self.update(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                        [s["exp_avg_sq"] for s in states], [s["step"] for s in states], lr, divisor,
                        beta1, beta2, group["eps"], group["weight_decay"], [s["master"] for s in states])


def step_variant(name: str, active: set[str], args, config) -> None:
    torch._dynamo.reset()
    # call 1 launched the per-lane kernel with 8 warps (its row_terms took them from a constant); the
    # library's row_terms launches with Triton's default of 4
    head_kernel._row_stats = lane_row_stats if "stats" in active else LIBRARY_ROW_STATS
    model_module.Rotary.forward = table_rotary if "rope" in active else LIBRARY_ROTARY
    model, optimizer = random_drafter(config, "cuda")
    if "bf16" in active:
        groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in optimizer.param_groups]
        optimizer = MasterAdamW(model, groups, lr=1e-4, betas=(0.9, 0.95))
    runner = DrafterRunner(model, compiled=True, token_budget=args.tokens, anchor_budget=args.anchors)
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
    print(f"step {name:>6}: {step_s * 1e3:.1f} ms (median {statistics.median(times) * 1e3:.1f})  MFU {flops / step_s / 790e12:.1%}  "
          f"warm-up {warm:.0f} s  peak {torch.cuda.max_memory_allocated() / 1e9:.1f} GB  "
          f"losses {' '.join(f'{l.item():.4f}' for l in losses[:6])}", flush=True)
    del model, optimizer, runner
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="base,rope,stats,bf16")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--skip-kernel", action="store_true")
    args = parser.parse_args()
    if not args.skip_kernel:
        row_stats_alone()
    config = load_drafter_config("qwen3.6-27b")
    order = ["base", "rope", "stats", "bf16"]
    for name in args.variants.split(","):
        step_variant(name, set(order[1: order.index(name) + 1]), args, config)


if __name__ == "__main__":
    main()
