"""Recompilations in drafter training: eager and compiled, over batches whose shapes never repeat.

    PYTHONPATH=. python benchmarks/recompiles.py [--preset tiny|qwen3.6-27b|FILE] [--device cpu|cuda]
                 [--tokens 16384] [--anchors 512] [--steps 500] [--warmup 20] [--modes eager,compiled]
                 [--backend inductor|aot_eager] [--json FILE]

Each step is a training step as `dflash-cache train` runs it (bf16 autocast, forward, backward,
gradient clipping, AdamW) on a new packed batch: lognormal sample lengths packed up to a budget that
itself varies, so that no two batches share their list of lengths and the total token count changes
from step to step (`distinct_length_plans`); anchors are drawn per batch, so their number changes too.
What torch.compile compiled is counted (`CompileCounts`: frames dynamo compiled, graphs handed to the
backend, failed guards with their text, frames left to eager) separately for the first --warmup steps
and for every step after; the claim checked is that nothing compiles after the warm-up. Each mode
starts from `torch._dynamo.reset()`.

Eager mode compiles its regions (drafter/regions.py: each decoder layer, the context projection, the
loss math) for dynamic shapes on CUDA; on the CPU it trains through the dense reference attention
(flex-attention has no CPU backward) and compiles nothing.
Compiled mode compiles the whole drafter on inputs padded to --tokens and --anchors. The default
backend is inductor on CUDA and aot_eager on the CPU (the same capture, guards and autograd graphs
as inductor, without minutes of C++ compilation); --backend overrides it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.drafter import random_drafter, train_step
from dflash_cache.drafter.anchors import sample_anchors
from dflash_cache.drafter.compile_audit import CompileCounts, distinct_length_plans
from dflash_cache.drafter.config import DrafterConfig
from dflash_cache.drafter.config_file import load_drafter_config
from dflash_cache.drafter.runner import DrafterRunner
from dflash_cache.stream.batch import FeatureBatch

# Both layer types, GQA, a window that cuts context: every code path of the drafter, CPU-sized.
TINY = DrafterConfig(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    rope_theta=10000.0,
    block_size=8,
    target_layer_ids=[0, 2],
    mask_token_id=511,
    num_target_layers=4,
    layer_types=["sliding_attention", "full_attention"],
    sliding_window=64,
)


def packed_batch(config: DrafterConfig, lengths: list[int], seed: int, device: str) -> FeatureBatch:
    """Random tokens and hidden states; the first 10-30% of each sample outside the loss mask."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    mask = torch.zeros(total, dtype=torch.bool)
    start = 0
    for n in lengths:
        mask[start + int(n * (0.1 + 0.2 * float(torch.rand(1, generator=g)))) : start + n] = True
        start += n
    width = len(config.target_layer_ids) * config.target_hidden_size
    gd = torch.Generator(device=device).manual_seed(seed)
    return FeatureBatch(
        sample_ids=list(range(len(lengths))),
        input_ids=torch.randint(0, config.vocab_size - 1, (total,), generator=g).to(device),
        loss_mask=mask.to(device),
        target_ids=torch.randint(0, config.vocab_size - 1, (total,), generator=g).to(device),
        hidden=torch.randn(total, width, generator=gd, device=device, dtype=torch.bfloat16),
        cu_seqlens=torch.tensor([0] + lengths).cumsum(0).int().to(device),
    )


def run_mode(mode: str, args, config: DrafterConfig, plans: list[list[int]]) -> dict:
    device = args.device
    torch._dynamo.reset()
    model, optimizer = random_drafter(config, device)
    runner = DrafterRunner(
        model, compiled=mode == "compiled", token_budget=args.tokens, anchor_budget=args.anchors, backend=args.backend
    )
    g = torch.Generator(device=device).manual_seed(0)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    started = CompileCounts.now()
    warmup = after = None
    compiling_steps, times, shapes = [], [], set()
    wall = time.perf_counter()
    for k, lengths in enumerate(plans):
        if k == args.warmup:
            warmup = CompileCounts.now() - started
        batch = packed_batch(config, lengths, seed=k, device=device)
        anchors = sample_anchors(batch, config.block_size, args.anchors, g, max_total=args.anchors)
        shapes.add((len(lengths), batch.num_tokens, anchors.numel()))
        before = CompileCounts.now()
        sync()
        t0 = time.perf_counter()
        loss = train_step(runner, model, optimizer, batch, anchors, device)
        sync()
        times.append(time.perf_counter() - t0)
        if k >= args.warmup and (CompileCounts.now() - before).compiled_anything:
            compiling_steps.append(k)
        if args.progress and (k + 1) % args.progress == 0:
            so_far = CompileCounts.now() - started
            print(
                f"  {mode} step {k + 1}/{len(plans)}: {statistics.median(times[-args.progress :]) * 1e3:.1f} ms/step, "
                f"loss {loss.item():.3f}, so far {so_far.frames} frames compiled, {so_far.left_to_eager} left to eager, "
                f"{len(compiling_steps)} steps compiled after the warm-up",
                flush=True,
            )
    end = CompileCounts.now()
    warmup = warmup if warmup is not None else end - started
    after = end - started - warmup if len(plans) > args.warmup else CompileCounts()
    return {
        "mode": mode,
        "backend": args.backend if mode == "compiled" or device == "cuda" else None,
        "steps": len(plans),
        "warmup_steps": min(args.warmup, len(plans)),
        "distinct_shapes": len(shapes),  # (sequences, tokens, anchors)
        "distinct_token_counts": len({s[1] for s in shapes}),
        "warmup": warmup.to_dict(),
        "after_warmup": after.to_dict(),
        "steps_that_compiled_after_warmup": compiling_steps,
        "step_ms_median": statistics.median(times) * 1e3,
        "step_ms_median_after_warmup": statistics.median(times[args.warmup :] or times) * 1e3,
        "wall_s": time.perf_counter() - wall,
        "loss_last": loss.item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", help="tiny, a drafter preset, or a JSON file")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=None, help="token budget (default 16384 on CUDA, 512 on the CPU)")
    parser.add_argument("--anchors", type=int, default=None, help="anchor budget (default 512 on CUDA, 32 on the CPU)")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--compiled-steps", type=int, default=None, help="steps of compiled mode (default --steps)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument(
        "--backend", default=None, help="torch.compile backend (default inductor on CUDA, aot_eager on the CPU)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--progress", type=int, default=50, help="print a line every N steps (0: none)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cuda = args.device == "cuda"
    args.tokens = args.tokens or (16384 if cuda else 512)
    args.anchors = args.anchors or (512 if cuda else 32)
    args.backend = args.backend or ("inductor" if cuda else "aot_eager")
    config = TINY if args.preset == "tiny" else load_drafter_config(args.preset)
    results = []
    columns = f"{'frames':>6} {'graphs':>6} {'guards':>6} {'eager':>5}"
    print(
        f"{'mode':>9} {'steps':>6} {'shapes':>7} | warm-up: {columns} | after: {columns} {'steps':>5} | ms/step",
        flush=True,
    )
    for mode in args.modes.split(","):
        steps = args.compiled_steps if mode == "compiled" and args.compiled_steps is not None else args.steps
        plans = distinct_length_plans(steps, args.tokens, seed=args.seed)
        r = run_mode(mode, args, config, plans)
        results.append(r)
        w, a = r["warmup"], r["after_warmup"]
        counts = lambda c: f"{c['frames']:>6} {c['graphs']:>6} {c['recompile_reasons']:>6} {c['left_to_eager']:>5}"  # noqa: E731
        print(
            f"{mode:>9} {r['steps']:>6} {r['distinct_shapes']:>7} | warm-up: {counts(w)} | after: {counts(a)} "
            f"{len(r['steps_that_compiled_after_warmup']):>5} | {r['step_ms_median_after_warmup']:.1f}",
            flush=True,
        )
        for reason in a["first_reasons"]:
            print(f"           recompiled: {reason}")
        if cuda:
            torch.cuda.empty_cache()
        if args.json:  # after each mode, so that a run stopped in a later mode keeps the earlier ones
            args.json.write_text(
                json.dumps(
                    {
                        "preset": args.preset,
                        "device": args.device,
                        "tokens": args.tokens,
                        "anchors": args.anchors,
                        "torch": torch.__version__,
                        "results": results,
                    },
                    indent=2,
                )
            )


if __name__ == "__main__":
    main()
