"""Drafter training-step throughput and model-FLOPs utilisation, eager and compiled.

    python benchmarks/drafter.py [--preset qwen3.6-27b] [--tokens 16384] [--anchors 512]
                                 [--modes plain,eager,compiled] [--steps 10] [--tile 128] [--compile-mode M] [--json FILE] [--profile DIR]
                                 [--peer "env LOSS_IMPL=eager SHAPE=27b python3 speculators_dflash_step.py"]

The step is what `dflash-cache train` runs: bf16 autocast, forward (flex attention, fused chunked LM-head
cross-entropy), backward, gradient clipping at 1.0 inside train's compiled AdamW, whose fp32 masters the
drafter's bf16 matrices copy (train/optim.py: build_optimizer, clipped_step).
Modes: eager (what `train` runs without --compile: on a GPU the decoder layers, context projection and
loss math are regions compiled for dynamic shapes), plain (eager without the regions: the module as
written, only flex-attention compiled) and compiled (`train --compile`: the whole drafter, padded).
--peer runs a script of speculators 0.9.0's DFlash training step first (a command that reads T and MAX_ANCHORS
from its environment and prints one JSON line), in its own process, with this run's T and MAX_ANCHORS,
and prints each mode's tokens/s as a ratio to that step's real tokens/s.
Batches are that script's own two (`peer_batches`): packed samples of 1000-4000 tokens
up to --tokens, the first 10-30% of each sample outside the loss mask, random hidden states and
token ids, the same samples as it draws; --anchors anchors per batch; the two alternate.
tokens/s counts the batches' real tokens, to be set beside its real_tokens_per_s (its
tokens_per_s counts the padding to T as well).

MFU counts the useful matmul and attention FLOPs of a step (the same terms as speculators 0.9.0's script,
minus its second LM-head pass, which this drafter does not make because the cache stores the
target's argmax, and with the LM head over the B - 1 predicted rows of a block where that
script counts B, 1.3 points of MFU more) against --peak-tflops.
Mask building (BlockMask for both layer types), which the eager modes do between their kernels, is
timed on its own and reported as a share of the step; the compiled drafter builds its masks inside
its graph.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.profiling import profile_run
from dflash_cache.choices import DEFAULT_LOSS
from dflash_cache.drafter.anchors import sample_anchors
from dflash_cache.drafter.config_file import load_drafter_config
from dflash_cache.drafter.head import TargetHead
from dflash_cache.drafter.inputs import DraftInputs
from dflash_cache.drafter.model import DFlashDrafter
from dflash_cache.drafter.runner import DrafterRunner
from dflash_cache.stream.batch import FeatureBatch
from dflash_cache.train.optim import build_optimizer, clipped_step, gradient_norm

PEER_SEED = 1234  # the generator seed of speculators 0.9.0's step script


def peer_batches(config, tokens: int, device: str, count: int = 2) -> list[FeatureBatch]:
    """The batches of speculators 0.9.0's step script, sample for sample: its packing (whole samples of 1000-4000 tokens while
    they fit in `tokens`; the first 10-30% of each outside the loss mask) and its random hidden states
    and token ids, drawn from one generator with its seed in its order, its verifier states included
    so that the next batch draws the same. Token counts per step then match its exactly."""
    g, targets = torch.Generator().manual_seed(PEER_SEED), torch.Generator().manual_seed(PEER_SEED + 1)
    return [_peer_batch(config, tokens, g, targets).to(device) for _ in range(count)]


def _peer_batch(config, tokens: int, g: torch.Generator, targets: torch.Generator) -> FeatureBatch:
    lengths, total = [], 0
    while True:
        n = int(torch.randint(1000, 4001, (1,), generator=g))
        if total + n > tokens:
            break
        lengths.append(n)
        total += n
    if not lengths:
        lengths, total = [tokens], tokens
    mask = torch.zeros(total, dtype=torch.bool)
    start = 0
    for n in lengths:
        prompt = int(n * (0.1 + 0.2 * float(torch.rand(1, generator=g))))
        mask[start + prompt : start + n] = True
        start += n
    hidden = torch.randn(total, len(config.target_layer_ids) * config.target_hidden_size, generator=g).bfloat16()
    torch.randn(total, config.target_hidden_size, generator=g)  # the script's verifier states: drawn, not used
    return FeatureBatch(
        sample_ids=list(range(len(lengths))),
        input_ids=torch.randint(0, config.vocab_size - 1, (total,), generator=g),
        loss_mask=mask,
        target_ids=torch.randint(0, config.vocab_size - 1, (total,), generator=targets),
        hidden=hidden,
        cu_seqlens=torch.tensor([0] + lengths).cumsum(0).int(),
    )


def step_flops(config, batch: FeatureBatch, anchors: torch.Tensor) -> float:
    """Useful FLOPs of one training step (forward + backward)."""
    h, i, v, b = config.hidden_size, config.intermediate_size, config.vocab_size, config.block_size
    nh, nkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    t, a = batch.num_tokens, anchors.numel()
    tq, tkv = a * b, t + a * b
    pos = batch.position_ids()[anchors].double()
    pairs = {
        "full_attention": a * b * (pos.mean().item() + b),
        "sliding_attention": a * b * (pos.clamp(max=config.sliding_window or 0).mean().item() + (b + 1) / 2),
    }
    per_layer = 4 * tq * h * nh * d + 4 * tkv * h * nkv * d + 6 * tq * h * i
    attention = sum(4 * nh * d * pairs[kind] for kind in config.layer_types)
    layers_fwd = config.num_hidden_layers * per_layer + attention
    fc = 2 * t * len(config.target_layer_ids) * config.target_hidden_size * h
    lm_head = 2 * a * (b - 1) * h * v  # the rows predicted: 15 of a block's 16 (speculators' script counts 16)
    # layers: forward + 2x backward; fc: forward + weight gradient; frozen LM head: forward + input gradient
    return 3 * layers_fwd + 2 * fc + 2 * lm_head


def random_drafter(config, device: str, tile: int = 128) -> tuple[DFlashDrafter, torch.optim.AdamW]:
    """The drafter of `config` over a random frozen target head, and train's AdamW for it, seeded; `tile`
    its BlockMask tile size."""
    torch.manual_seed(0)
    with torch.device(device):  # built in place: on the CPU the 27B drafter's initialisation took a minute
        head = TargetHead(
            embed_tokens=torch.randn(config.vocab_size, config.hidden_size) * 0.02,
            norm=torch.ones(config.hidden_size),
            lm_head=torch.randn(config.vocab_size, config.hidden_size) * 0.02,
        ).to(dtype=torch.bfloat16)
        model = DFlashDrafter(config, head, tile=tile)
    return model, build_optimizer(model, lr=1e-4, weight_decay=0.01)


def train_step(
    runner: DrafterRunner, model: DFlashDrafter, optimizer, batch: FeatureBatch, anchors: torch.Tensor, device: str
) -> torch.Tensor:
    """One step as `dflash-cache train` runs it: bf16 autocast, backward, clipping at 1.0, AdamW; the loss."""
    with torch.autocast(device, dtype=torch.bfloat16):
        out = runner(batch, anchors, loss=DEFAULT_LOSS)
    optimizer.zero_grad(set_to_none=True)
    out.loss.backward()
    clipped_step(optimizer, gradient_norm(model.parameters()), 1.0)
    return out.loss.detach().clone()  # a CUDA graph's output is overwritten by its next replay


def drafter_step(
    config, device: str, mode: str, tokens: int, anchor_budget: int, tile: int = 128, compile_mode: str | None = None
) -> tuple[Callable[[int], torch.Tensor], DFlashDrafter, list[FeatureBatch], list[torch.Tensor]]:
    """(step k -> its loss, the drafter, peer_batches' two batches, their anchors): train_step on batch k % 2
    for a random drafter of `config` run in `mode` (plain, eager or compiled)."""
    model, optimizer = random_drafter(config, device, tile)
    runner = DrafterRunner(
        model,
        compiled=mode == "compiled",
        token_budget=tokens,
        anchor_budget=anchor_budget,
        regions=False if mode == "plain" else None,
        compile_mode=compile_mode,
    )
    batches = peer_batches(config, tokens, device)
    g = torch.Generator(device=device).manual_seed(0)
    anchors = [sample_anchors(batch, config.block_size, anchor_budget, g, max_total=anchor_budget) for batch in batches]

    def step(k: int) -> torch.Tensor:
        return train_step(runner, model, optimizer, batches[k % 2], anchors[k % 2], device)

    return step, model, batches, anchors


def timed_steps(
    step: Callable[[int], torch.Tensor],
    warmup: int,
    steps: int,
    device: str,
    progress: Callable[[int, float], None] | None = None,
) -> tuple[float, list[float], list[torch.Tensor]]:
    """(warm-up seconds, each timed step's seconds, every step's loss): `warmup` steps, then `steps` timed
    ones, each waited for; the GPU's peak memory counts from the first timed step."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    started, losses = time.perf_counter(), []
    for k in range(warmup):
        losses.append(step(k))
        sync()
        if progress:
            progress(k, time.perf_counter() - started)
    warmup_s = time.perf_counter() - started
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for k in range(steps):
        sync()
        t0 = time.perf_counter()
        losses.append(step(k))
        sync()
        times.append(time.perf_counter() - t0)
    return warmup_s, times, losses


def run_mode(mode: str, args, config, device: str) -> dict:
    step, model, batches, anchors = drafter_step(
        config, device, mode, args.tokens, args.anchors, args.tile, args.compile_mode
    )
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def progress(k: int, seconds: float) -> None:
        print(f"  {mode} warm-up step {k + 1}/{args.warmup}: {seconds:.1f} s", flush=True)

    warmup_s, times, losses = timed_steps(step, args.warmup, args.steps, device, progress)
    losses = losses[args.warmup :]
    if args.profile:
        profile_run(args.profile, f"drafter_{mode}", lambda: [step(k) for k in range(3)])
    mask_times = []
    for k in range(args.steps):
        inputs = DraftInputs.build(batches[k % 2], anchors[k % 2])
        sync()
        t0 = time.perf_counter()
        model.masks(inputs)
        sync()
        mask_times.append(time.perf_counter() - t0)
    step_s = statistics.mean(times)
    tokens = statistics.mean(batches[k % 2].num_tokens for k in range(args.steps))
    flops = statistics.mean(step_flops(config, batches[k % 2], anchors[k % 2]) for k in range(args.steps))
    return {
        "mode": mode,
        "tokens_per_step": tokens,
        "anchors_per_step": statistics.mean(a.numel() for a in anchors),
        "tokens_per_s": tokens / step_s,
        "step_ms": step_s * 1e3,
        "step_ms_median": statistics.median(times) * 1e3,
        "mfu": flops / step_s / (args.peak_tflops * 1e12),
        "model_tflop_per_step": flops / 1e12,
        "mask_ms": statistics.mean(mask_times) * 1e3,
        "mask_share": statistics.mean(mask_times) / step_s,
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None,
        "warmup_s": warmup_s,
        "loss_first": losses[0].item(),
        "loss_last": losses[-1].item(),
    }


def run_peer(command: str, tokens: int, anchors: int) -> dict:
    """The JSON line of a speculators step script, from `command` run with T and MAX_ANCHORS set to ours. The process is
    stopped once it has printed that line (it was seen to linger a minute after printing it)."""
    env = {**os.environ, "T": str(tokens), "MAX_ANCHORS": str(anchors)}
    proc = subprocess.Popen(shlex.split(command), stdout=subprocess.PIPE, text=True, env=env)
    try:
        for line in proc.stdout:
            line = line.strip()
            if line.startswith("{"):
                result = json.loads(line)
                if "real_tokens_per_s" in result:
                    return result
        raise SystemExit(f"the speculators step printed no result line (exit {proc.poll()}): {command}")
    finally:
        proc.kill()
        proc.wait()


def add_step_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The drafter step's shape, shared by the drafter benchmarks: preset, tokens and anchors a step."""
    parser.add_argument("--preset", default="qwen3.6-27b", help="drafter preset or JSON file")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--anchors", type=int, default=512)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_shape_arguments(parser)
    parser.add_argument("--modes", default="eager,compiled", help="comma-separated: eager, plain, compiled")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--peak-tflops", type=float, default=790.0, help="bf16 dense peak used for MFU (measured on an H200)"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="after each mode's timed steps, profile 3 more: a trace and a table sorted by GPU time here",
    )
    parser.add_argument(
        "--compile-mode",
        default=None,
        help="torch.compile's mode for the compiled step (reduce-overhead: CUDA graphs; "
        "max-autotune-no-cudagraphs: Inductor's autotuning, flex-attention's included)",
    )
    parser.add_argument(
        "--tile",
        type=int,
        default=128,
        help="BlockMask tile size (train uses 128; smaller tiles cover fewer masked-out pairs)",
    )
    parser.add_argument(
        "--peer",
        default=None,
        help="a command running speculators 0.9.0's step, run first (T and MAX_ANCHORS are set to ours)",
    )
    args = parser.parse_args()
    config = load_drafter_config(args.preset)
    results = []
    peer = run_peer(args.peer, args.tokens, args.anchors) if args.peer else None
    if peer:
        print(
            f"    peer: {peer['real_tokens_per_s']:>9,.0f} real tokens/s  MFU {peer.get('mfu', 0):.1%}  step {peer['step_ms']:.1f} ms  "
            f"peak {peer.get('peak_mem_gb') or 0:.1f} GB  ({peer['real_tokens_per_step']:.0f} tokens, "
            f"{peer.get('anchors_per_step', 0):.0f} anchors; loss {peer.get('loss_first', 0):.3f} -> {peer.get('loss_last', 0):.3f})",
            flush=True,
        )
    for mode in args.modes.split(","):
        result = run_mode(mode, args, config, args.device)
        results.append(result)
        if peer:
            result["vs_peer"] = result["tokens_per_s"] / peer["real_tokens_per_s"]
        ratio = f" = {result['vs_peer']:.3f}x speculators" if peer else ""
        masks = (
            "masks in the graph"
            if mode == "compiled"
            else f"masks {result['mask_ms']:.2f} ms ({result['mask_share']:.1%} of the step)"
        )
        print(
            f"{mode:>8}: {result['tokens_per_s']:>9,.0f} tokens/s{ratio}  MFU {result['mfu']:.1%}  step {result['step_ms']:.1f} ms  "
            f"{masks}  peak {result['peak_mem_gb'] or 0:.1f} GB  "
            f"({result['tokens_per_step']:.0f} tokens, {result['anchors_per_step']:.0f} anchors; loss {result['loss_first']:.3f} -> {result['loss_last']:.3f})",
            flush=True,
        )
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps({"preset": args.preset, "peer": peer, "results": results}, indent=2))


if __name__ == "__main__":
    main()
