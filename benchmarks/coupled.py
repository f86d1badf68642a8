"""The coupled baseline against training from a cache: drafter training tokens/s on two GPUs.

    PYTHONPATH=. python benchmarks/coupled.py [--shape qwen3-8b] [--drafter qwen3.6-27b] [--tokens 16384]
                                              [--warmup 4] [--steps 20] [--json FILE]
    PYTHONPATH=. python benchmarks/coupled.py --shape tiny --tokens 512 --max-anchors 8 --warmup 1 --steps 2 --device cpu

A random-weight target built in place (benchmarks/targets.py), random-token samples (lengths
log-uniform from 1/64 to 1/4 of --tokens: 256-4096 at the default) for --warmup + --steps batches of
--tokens, and one drafter preset (fitted to the target by the trainer, as `train` does), trained by
the real trainer with the same options in both runs:
  coupled: as `train --live-target T --target-gpus 0 --gpus 1`: the target on cuda:0 computes each
           batch when the step asks for it (padded forwards of <= --tokens) for the drafter on cuda:1
  cache:   the same samples extracted once into a bf16-zstd cache by the extraction loop (timed
           apart), then `train --cache C --gpus 0,1`: two DDP ranks, one per GPU. Two batches a step,
           so it goes through the samples about twice (a fresh loader starts the second epoch).
A run's tokens/s is the tokens it trained on over its step times after the --warmup steps (its
metrics.jsonl); goal: cache >= 2x coupled. Peak memory is what torch allocated on each GPU (for
the cache run, rank 0's). Neither run writes checkpoints (`--save-every 0`): they are not what is
compared, and each would be a write of the drafter with its optimizer state (about 16 GB).
With --device cpu everything runs on the CPU (the cache run as two processes): a smoke test.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from benchmarks.targets import SHAPES, build_target, make_samples, target_config
from dflash_cache.data.plan import plan_batches
from dflash_cache.extract.buckets import BucketLayout
from dflash_cache.extract.worker import RankJob, run_rank
from dflash_cache.store.manifest import build_manifest, read_journals, write_manifest
from dflash_cache.target.target import Target
from dflash_cache.train.config import TrainConfig
from dflash_cache.train.distributed import init_rank, shutdown
from dflash_cache.train.metrics import METRICS_FILE
from dflash_cache.train.rundir import RUN_FILE
from dflash_cache.train.source import open_source
from dflash_cache.train.train import prepare, run, train

CODEC = "bf16-zstd"
GB = 1e9


def write_data(path: Path, total_tokens: int, vocab: int, tokens: int, batches: int) -> tuple[int, int]:
    """Pre-tokenized JSONL of random samples making at least `batches` training batches of `tokens`;
    returns (samples, tokens in them)."""
    longest = min(4096, tokens // 4)
    while True:
        samples = make_samples(total_tokens, vocab, shortest=longest // 16, longest=longest)
        lengths = [len(s.input_ids) for s in samples]
        if len(plan_batches(list(range(len(samples))), lengths, tokens, seed=0)) >= batches:
            break
        total_tokens = int(total_tokens * 1.05)
    with open(path, "w") as f:
        f.writelines(json.dumps({"input_ids": s.input_ids.tolist()}) + "\n" for s in samples)
    return len(samples), sum(lengths)


def steady_tok_s(run_dir: Path, warmup: int) -> tuple[float, float]:
    """(tokens/s over the steps after `warmup`, peak GiB the trainer reported) of a finished run."""
    records = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]
    steps = [r for r in records if "loss" in r and r["step"] > warmup]
    peak = max((r.get("gpu_mem_gib", 0.0) for r in records if "loss" in r), default=0.0)
    return sum(r["tokens"] for r in steps) / sum(r["step_time_s"] for r in steps), peak


def peak_gb(device: str) -> float:
    return torch.cuda.max_memory_allocated(device) / GB if device.startswith("cuda") else 0.0


def train_coupled(cfg: TrainConfig, target: Target, device: str) -> None:
    """`train --live-target` in this process, with the target built in place instead of loaded."""
    cfg.check()
    epoch_steps, lock = prepare(cfg, 1, print)
    with lock:
        me = init_rank(0, 1, device, cfg.collective_timeout_s)
        try:
            run(me, cfg, print, open_source(cfg, target=target), epoch_steps)
        finally:
            shutdown()


def extract_cache(cfg: TrainConfig, target: Target, root: Path, tokens: int) -> tuple[float, int]:
    """The samples `cfg` trains on, extracted as `extract --batching padded --token-budget TOKENS --codec
    bf16-zstd` would (its per-rank loop, one rank; padded, as the live target runs); returns (seconds,
    bytes stored)."""
    live = open_source(cfg, target=target).live
    samples = live.samples  # sample id -> Sample
    layout = BucketLayout(tokens, max(live.lengths))
    batches = layout.plan(list(samples), live.lengths)
    job = RankJob(
        root=root,
        target_path=target.path,
        device=str(live.device),
        rank=0,
        spec={**live.spec, "codec": CODEC},
        layout=layout,
        batches=batches,
        samples=samples,
        done=set(),
        first_shard_index=0,
        compress_threads=8,
        write_target_files=True,
    )
    start = time.perf_counter()
    with torch.cuda.device(live.device) if live.device.type == "cuda" else nullcontext():  # the worker's streams
        summary = run_rank(job, target=target)
    write_manifest(root, build_manifest(read_journals(root)))
    return time.perf_counter() - start, summary.bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="qwen3-8b", help="the target's shape")
    parser.add_argument("--layers-cut", type=int, default=None, help="layers of the cut 27B shape (a multiple of 4)")
    parser.add_argument("--drafter", default="qwen3.6-27b", help="drafter preset or JSON file")
    parser.add_argument("--tokens", type=int, default=16384, help="token budget of a batch (per rank)")
    parser.add_argument(
        "--max-anchors",
        type=int,
        default=48,
        help="the trainer's --max-anchors (per sequence): 48 gives about 470 anchors per batch of 16384 "
        "tokens, near the 512 per step of benchmarks/drafter.py",
    )
    parser.add_argument("--warmup", type=int, default=4, help="steps of each run left out of the timing")
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each run")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if cuda and torch.cuda.device_count() < 2:
        parser.error(f"needs 2 GPUs, {torch.cuda.device_count()} visible")
    target_device, drafter_device = ("cuda:0", "cuda:1") if cuda else ("cpu", "cpu")
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench-coupled-"))
    config = target_config(args.shape, args.layers_cut)
    target = build_target(config, target_device, work / "target")
    steps = args.warmup + args.steps
    data = work / "data.jsonl"
    num_samples, data_tokens = write_data(data, steps * args.tokens * 3 // 4, config.vocab_size, args.tokens, steps)
    print(
        f"target: {args.shape} ({config.num_hidden_layers} layers, hidden {config.hidden_size}), random weights, "
        f"on {target_device}; data: {num_samples} samples, {data_tokens} tokens; batches of <= {args.tokens} tokens, "
        f"{args.warmup} + {args.steps} steps a run",
        flush=True,
    )
    common = {
        "drafter": args.drafter,
        "steps": steps,
        "token_budget": args.tokens,
        "max_anchors": args.max_anchors,
        "eval_fraction": 0.0,
        "seed": 0,
        "save_every": 0,
    }

    coupled = TrainConfig(
        out=str(work / "coupled"),
        live_target=str(target.path),
        data=[str(data)],
        num_draft_layers=5,
        **({"gpus": [1], "target_gpus": [0]} if cuda else {"cpu_procs": 1}),
        **common,
    )
    if cuda:
        for device in (target_device, drafter_device):
            torch.cuda.reset_peak_memory_stats(device)
    tick = time.perf_counter()
    train_coupled(coupled, target, drafter_device)
    coupled_s = time.perf_counter() - tick
    coupled_tok_s, _ = steady_tok_s(work / "coupled", args.warmup)
    coupled_peak = {"target": peak_gb(target_device), "drafter": peak_gb(drafter_device)}
    # Printed at once, so that a run stopped later still leaves this figure behind.
    print(f"coupled: {coupled_tok_s:,.0f} tokens/s after the warm-up steps ({coupled_s:.0f} s with set-up)", flush=True)
    drafter = json.loads((work / "coupled" / RUN_FILE).read_text())["drafter"]

    extract_s, stored = extract_cache(coupled, target, work / "cache", args.tokens)
    print(f"extracted {data_tokens} tokens in {extract_s:.1f} s ({stored / data_tokens:,.0f} bytes/token)", flush=True)
    del target
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()

    cached = TrainConfig(
        out=str(work / "cached"),
        caches=[str(work / "cache")],
        **({"gpus": [0, 1]} if cuda else {"cpu_procs": 2}),
        **common,
    )
    tick = time.perf_counter()
    train(cached, echo=print)
    cache_s = time.perf_counter() - tick
    cache_tok_s, cache_peak_gib = steady_tok_s(work / "cached", args.warmup)
    print(f"cache: {cache_tok_s:,.0f} tokens/s after the warm-up steps ({cache_s:.0f} s with set-up)", flush=True)

    ratio = cache_tok_s / coupled_tok_s
    result = {
        "shape": args.shape,
        "target_layers": config.num_hidden_layers,
        "target_hidden": config.hidden_size,
        "drafter": args.drafter,
        "drafter_hidden": drafter["hidden_size"],
        "drafter_layers": drafter["num_hidden_layers"],
        "drafter_vocab": drafter["vocab_size"],
        "tokens_per_batch": args.tokens,
        "max_anchors": args.max_anchors,
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "samples": num_samples,
        "data_tokens": data_tokens,
        "device": args.device,
        "coupled_tok_s": coupled_tok_s,
        "cache_tok_s": cache_tok_s,
        "cache_ranks": 2,
        "ratio": ratio,
        "extract_tok_s": data_tokens / extract_s,
        "bytes_per_token": stored / data_tokens,
        "peak_gb": {
            "coupled_target": coupled_peak["target"],
            "coupled_drafter": coupled_peak["drafter"],
            "cache_rank0": cache_peak_gib * 2**30 / GB,
        },
        "wall_s": {
            "coupled_run": coupled_s,
            "extract": extract_s,
            "cache_run": cache_s,
            "total": time.perf_counter() - started,
        },
    }
    print(f"coupled (target {target_device} -> drafter {drafter_device}): {coupled_tok_s:,.0f} tokens/s")
    print(f"cache (2 drafter ranks):  {cache_tok_s:,.0f} tokens/s")
    print(f"ratio:                    {ratio:.2f}x (goal >= 2x: {'met' if ratio >= 2 else 'not met'})")
    print(
        f"peak memory: coupled target {coupled_peak['target']:.1f} GB, drafter {coupled_peak['drafter']:.1f} GB; "
        f"cache rank 0 {result['peak_gb']['cache_rank0']:.1f} GB; {result['wall_s']['total']:.0f} s in all"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
