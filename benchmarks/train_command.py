"""`dflash-cache train` as a user runs it, against the benchmark's step on the same batches and anchors.

    PYTHONPATH=. python benchmarks/train_command.py [--preset qwen3.6-27b] [--tokens 16384] [--max-anchors 64]
                                                    [--anchors-per-batch N] [--steps 25] [--warmup 5]
                                                    [--modes eager,compiled] [--optimizers muon,adamw]
                                                    [--command "dflash-cache"] [--defaults N]
                                                    [--no-step] [--profile DIR] [--work DIR] [--json FILE]

1. A synthetic bf16-zstd cache shaped like the preset's target (for qwen3.6-27b: 5 layers x hidden 5120,
   vocabulary 248,320; samples of 1000-4000 tokens, random hidden states, as benchmarks/train.py writes
   it) with a random target head, on local disk; enough samples for --steps batches of --tokens.
2. With --defaults N: `train --drafter PRESET` with no size options, N steps in each mode: what the defaults give.
3. For each mode and optimizer, `train --drafter PRESET --token-budget T --max-anchors M --steps S
   --optimizer O` (`--compile` for compiled), in a new process with new empty Triton and Inductor caches: the tokens/s of the steps after
   --warmup, from the run's metrics.jsonl, its first --warmup steps' seconds, and the process's wall time.
4. Then, in this process, the same batches (the trainer's plan) and anchors (its seeds) through
   benchmarks/drafter.py's step for a drafter built as train builds it: the step without the training
   loop around it. The first step's loss must equal the trainer's (same weights, batch and anchors).
5. With --profile DIR: the eager trainer once more, in this process, profiled over the 4 steps after
   --warmup (a Chrome trace, the GPU's idle gaps and what launched the kernel after each), with CUDA's
   sync debug mode on for those steps: where the host waited for the GPU, by source line.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import shutil
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

import torch

import dflash_cache.train.train as trainer
from benchmarks.drafter import timed_steps, train_step
from benchmarks.profiling import gpu_idle
from benchmarks.train import write_cache
from dflash_cache.choices import DEFAULT_OPTIMIZER, OPTIMIZER_DEFAULTS
from dflash_cache.drafter.anchors import sample_anchors
from dflash_cache.drafter.config_file import load_drafter_config
from dflash_cache.drafter.head import TargetHead
from dflash_cache.drafter.runner import DrafterRunner
from dflash_cache.stream.caches import CacheSet
from dflash_cache.stream.epochs import TRAIN, EpochPlan, batch_seed
from dflash_cache.stream.loader import Loader
from dflash_cache.train.config import TrainConfig
from dflash_cache.train.model import build_drafter, check_head, drafter_config_for
from dflash_cache.train.optim import build_optimizer
from tests.support.train import write_head

SEED = 0  # train's default


def run_command(command: list[str], run_dir: Path, log: Path) -> dict:
    """The command in a new process with new empty compile caches; its exit code, wall seconds and metrics."""
    scratch = Path(tempfile.mkdtemp(prefix="compile-caches-"))
    env = {
        **os.environ,
        "TRITON_CACHE_DIR": str(scratch / "triton"),
        "TORCHINDUCTOR_CACHE_DIR": str(scratch / "inductor"),
    }
    started = time.perf_counter()
    with open(log, "w") as out:
        rc = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    wall = time.perf_counter() - started
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return {
        "rc": rc,
        "wall_s": wall,
        "steps": [r for r in records if "loss" in r],
        "last_line": log.read_text().strip().splitlines()[-1:],
    }


def steady(steps: list[dict], warmup: int) -> dict:
    timed = steps[warmup:]
    seconds = sum(r["step_time_s"] for r in timed)
    return {
        "tokens_per_s": sum(r["tokens"] for r in timed) / seconds,
        "step_ms": 1e3 * seconds / len(timed),
        "warmup_s": sum(r["step_time_s"] for r in steps[:warmup]),
        "blocks_per_step": sum(r["blocks"] for r in timed) / len(timed),
        "tokens_per_step": sum(r["tokens"] for r in timed) / len(timed),
        "first_loss": steps[0]["loss"],
        "peak_gib": max(r.get("gpu_mem_gib", 0) for r in steps),
    }


def harness(
    cache: Path,
    preset: str,
    mode: str,
    tokens: int,
    max_anchors: int,
    per_batch: int | None,
    steps: int,
    warmup: int,
    device: torch.device,
    optimizer_kind: str,
) -> dict:
    """benchmarks/drafter.py's step on the trainer's batches and anchors, with the trainer's drafter and
    optimizer at its default rate and weight decay."""
    caches = CacheSet([cache])
    keys, _ = caches.split(0.0)
    plan = EpochPlan(keys, caches.lengths, tokens, SEED, 1, 1)
    batches = plan.rank_batches(0, 0)[:steps]
    config, _ = drafter_config_for(preset, caches.spec, caches.head_dir)
    model = build_drafter(config, TargetHead.load(check_head(caches), device=device), device, SEED)
    optimizer = build_optimizer(model, *OPTIMIZER_DEFAULTS[optimizer_kind], optimizer_kind)
    anchor_budget = plan.anchor_bound(0, config.block_size, max_anchors) if mode == "compiled" else None
    anchor_budget = min(filter(None, (anchor_budget, per_batch)), default=None)  # as train takes them
    runner = DrafterRunner(
        model,
        compiled=mode == "compiled",
        anchor_budget=anchor_budget,
        token_budget=max(tokens, max(caches.lengths[k] for k in keys)),
    )
    with Loader(caches, batches, device) as loader:
        on_gpu = list(loader)
    anchors = [
        sample_anchors(
            b,
            config.block_size,
            max_anchors,
            torch.Generator(device).manual_seed(batch_seed(SEED, TRAIN, 0, i)),
            max_total=anchor_budget,
        )
        for i, b in enumerate(on_gpu)
    ]
    warmup_s, times, losses = timed_steps(
        lambda k: train_step(runner, model, optimizer, on_gpu[k], anchors[k], device.type), 0, len(on_gpu), device.type
    )
    timed = range(warmup, len(on_gpu))
    seconds = sum(times[k] for k in timed)
    caches.close()
    return {
        "tokens_per_s": sum(on_gpu[k].num_tokens for k in timed) / seconds,
        "step_ms": 1e3 * seconds / len(timed),
        "warmup_s": sum(times[:warmup]),
        "blocks_per_step": sum(anchors[k].numel() for k in timed) / len(timed),
        "first_loss": losses[0].item(),
    }


def profile_trainer(cache: Path, preset: str, tokens: int, max_anchors: int, warmup: int, folder: Path) -> None:
    """The eager trainer in this process, its steps warmup+1 .. warmup+4 (the last) profiled and sync-debugged."""
    from torch.profiler import ProfilerActivity, profile

    folder.mkdir(parents=True, exist_ok=True)
    profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    real_step, calls = trainer.train_step, [0]
    syncs: collections.Counter = collections.Counter()

    def step(*args, **kwargs):
        calls[0] += 1
        if calls[0] == warmup + 1:
            torch.cuda.synchronize()
            profiler.start()
            torch.cuda.set_sync_debug_mode("warn")
        return real_step(*args, **kwargs)

    trainer.train_step = step
    cfg = TrainConfig(
        caches=[str(cache)],
        out=str(folder / "run"),
        drafter=preset,
        token_budget=tokens,
        max_anchors=max_anchors,
        steps=warmup + 4,
        save_every=0,
        eval_fraction=0.0,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.train(cfg, echo=lambda line: None)
        finally:
            trainer.train_step = real_step
    for w in caught:
        if "called a synchronizing" in str(w.message):
            syncs[f"{Path(w.filename).name}:{w.lineno}: {str(w.message)[:70]}"] += 1
    torch.cuda.set_sync_debug_mode(0)
    profiler.stop()
    trace = folder / "train_eager_trace.json"
    profiler.export_chrome_trace(str(trace))
    report = [
        gpu_idle(trace, shown=20),
        "host waits for the GPU, by source line (count over the profiled steps):",
        *[f"  {n:4d}  {where}" for where, n in syncs.most_common()],
    ]
    (folder / "train_eager_profile.txt").write_text("\n".join(report) + "\n")
    print("\n".join(report), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3.6-27b")
    parser.add_argument("--tokens", type=int, default=16384, help="--token-budget of the runs")
    parser.add_argument("--max-anchors", type=int, default=64, help="--max-anchors of the runs (per sequence)")
    parser.add_argument("--anchors-per-batch", type=int, help="--anchors-per-batch of the runs (default: not given)")
    parser.add_argument("--steps", type=int, default=25, help="0: leave out 3. and 4.")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the tokens/s")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument(
        "--optimizers",
        default=DEFAULT_OPTIMIZER,
        help="train --optimizer of the runs, each in every mode (comma-separated: side by side)",
    )
    parser.add_argument("--command", default="dflash-cache", help="how to call the CLI")
    parser.add_argument(
        "--defaults",
        type=int,
        default=0,
        help="first, this many steps of each mode with train's default sizes (3 of them warm-up)",
    )
    parser.add_argument("--no-step", action="store_true", help="leave out 4. (the step alone on the same batches)")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--profile", type=Path, help="profile the eager trainer's loop into this folder (5. above)")
    parser.add_argument(
        "--device", default="cuda", help="cpu: a check of this script with a tiny drafter JSON as --preset"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    config = load_drafter_config(args.preset)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-train-command-"))
    cache = work / "cache"
    started = time.perf_counter()
    if not (cache / "manifest.json").exists():  # a --work of an earlier run keeps its cache
        # enough for every run: the defaults' batches hold 49,152 tokens, 3 x the usual --tokens
        write_cache(
            cache, config, int(1.2 * max(args.steps, 3 * args.defaults, args.warmup + 4) * args.tokens), device.type
        )
        write_head(cache, config.target_hidden_size, config.vocab_size)
    print(
        f"cache: {len(CacheSet([cache]).lengths)} samples, ready in {time.perf_counter() - started:.0f} s", flush=True
    )
    base = [
        *shlex.split(args.command),
        "train",
        "--cache",
        str(cache),
        "--drafter",
        args.preset,
        "--save-every",
        "0",
        "--eval-fraction",
        "0",
        "--log-every",
        "5",
    ]
    sizes = ["--token-budget", str(args.tokens), "--max-anchors", str(args.max_anchors)]
    if args.anchors_per_batch:
        sizes += ["--anchors-per-batch", str(args.anchors_per_batch)]
    results: dict = {
        "preset": args.preset,
        "tokens": args.tokens,
        "max_anchors": args.max_anchors,
        "anchors_per_batch": args.anchors_per_batch,
    }
    modes = args.modes.split(",")
    for mode in modes if args.defaults else []:
        name = f"defaults-{mode}"
        run = run_command(
            [
                *base,
                "--out",
                str(work / name),
                "--steps",
                str(args.defaults),
                *(["--compile"] if mode == "compiled" else []),
            ],
            work / name,
            work / f"{name}.log",
        )
        said = [
            line for line in (work / f"{name}.log").read_text().splitlines() if "blocks" in line and "step " not in line
        ]
        results[name] = {
            "rc": run["rc"],
            "said": said,
            "wall_s": run["wall_s"],
            **(steady(run["steps"], 3) if len(run["steps"]) > 3 else {"last_line": run["last_line"]}),
        }
        print(
            f"{name}: rc {run['rc']} in {run['wall_s']:.0f} s; " + "; ".join(said) + f"; {summary(results[name])}",
            flush=True,
        )
    optimizers = args.optimizers.split(",")
    runs = [(mode, kind) for mode in modes for kind in optimizers] if args.steps else []
    for mode, kind in runs:
        name = mode if len(optimizers) == 1 else f"{mode}-{kind}"
        out = work / f"run-{name}"
        shutil.rmtree(out, ignore_errors=True)
        command = [
            *base,
            "--out",
            str(out),
            *sizes,
            "--steps",
            str(args.steps),
            "--optimizer",
            kind,
            *(["--compile"] if mode == "compiled" else []),
        ]
        run = run_command(command, out, work / f"{name}.log")
        if run["rc"] != 0 or len(run["steps"]) < args.steps:
            raise SystemExit(f"{name}: train exited {run['rc']} after {len(run['steps'])} steps: {run['last_line']}")
        trainer_figures = {**steady(run["steps"], args.warmup), "wall_s": run["wall_s"]}
        results[name] = {"train": trainer_figures}
        line = f"{name}: train {summary(trainer_figures)}"
        if not args.no_step:
            bench = harness(
                cache,
                args.preset,
                mode,
                args.tokens,
                args.max_anchors,
                args.anchors_per_batch,
                args.steps,
                args.warmup,
                device,
                kind,
            )
            results[name].update(step=bench, ratio=trainer_figures["tokens_per_s"] / bench["tokens_per_s"])
            line += (
                f" | the step alone {bench['tokens_per_s']:,.0f} tokens/s ({bench['step_ms']:.1f} ms, "
                f"{bench['blocks_per_step']:.0f} blocks; first {args.warmup} steps {bench['warmup_s']:.1f} s) | train / step "
                f"{results[name]['ratio']:.3f} | first loss {trainer_figures['first_loss']:.4f} / {bench['first_loss']:.4f}"
            )
        print(line, flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if args.profile:
        profile_trainer(cache, args.preset, args.tokens, args.max_anchors, args.warmup, args.profile)


def summary(figures: dict) -> str:
    if "tokens_per_s" not in figures:
        return f"{figures.get('last_line')}"
    return (
        f"{figures['tokens_per_s']:,.0f} tokens/s ({figures['step_ms']:.1f} ms a step, {figures['blocks_per_step']:.0f} "
        f"blocks, {figures['tokens_per_step']:.0f} tokens; warm-up {figures['warmup_s']:.1f} s; process "
        f"{figures.get('wall_s', 0):.0f} s; peak {figures['peak_gib']:.1f} GiB)"
    )


if __name__ == "__main__":
    main()
