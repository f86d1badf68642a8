"""What verifying each shard's sha256 on first read costs the training stream, on the CPU.

    PYTHONPATH=. python benchmarks/shard_verify.py [--hidden 1024] [--tokens 60000] [--shard-mb 64]
                                                  [--workers 4] [--budget 8192] [--step-ms 0] [--json FILE]

A synthetic bf16-zstd cache like benchmarks/train.py's (the qwen3.6-27b preset's 5 layers) is
written in shards of --shard-mb, then read from the page cache through the real loader
(`stream.loader.Loader`, --workers reader threads, prefetch 4) into packed CPU batches of --budget
tokens, consumed by a stand-in for a training step that sleeps --step-ms per batch (0: nothing
consumes them, the loader alone sets the pace: the worst case for any cost it adds). One epoch on a
fresh CacheSet each time, with and without `verify_shards`, three times each, interleaved; medians
printed (tokens/s) and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.train import write_cache
from dflash_cache.data.plan import plan_batches
from dflash_cache.drafter.config_file import load_drafter_config
from dflash_cache.stream.caches import CacheSet
from dflash_cache.stream.loader import Loader


def one_epoch(root: str, verify: bool, budget: int, workers: int, step_s: float) -> float:
    """Tokens per second of one pass over every sample."""
    caches = CacheSet([root], verify_shards=verify)
    keys = list(range(len(caches)))
    plan = plan_batches(keys, caches.lengths, budget, seed=0)
    start = time.perf_counter()
    with Loader(caches, plan, "cpu", prefetch=4, workers=workers) as loader:
        for _ in loader:
            time.sleep(step_s)
    seconds = time.perf_counter() - start
    caches.close()
    return sum(caches.lengths) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3.6-27b")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=60000)
    parser.add_argument("--shard-mb", type=int, default=64)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--budget", type=int, default=8192)
    parser.add_argument("--step-ms", type=float, default=0.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = replace(load_drafter_config(args.preset), hidden_size=args.hidden, target_hidden_size=args.hidden)
    runs: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="bench-shard-verify-") as tmp:
        write_cache(Path(tmp), config, args.tokens, "cpu", shard_bytes=args.shard_mb << 20)
        shards = len(list((Path(tmp) / "shards").glob("*.arrow")))
        size = sum(p.stat().st_size for p in (Path(tmp) / "shards").glob("*.arrow"))
        one_epoch(tmp, False, args.budget, args.workers, 0.0)  # warm the page cache
        for _ in range(3):
            for verify in (False, True):
                runs[verify].append(one_epoch(tmp, verify, args.budget, args.workers, args.step_ms / 1000))
    plain, verified = statistics.median(runs[False]), statistics.median(runs[True])
    print(
        f"{shards} shards, {size / 1e6:,.0f} MB; {args.workers} reader threads, batches of {args.budget} tokens, "
        f"a step of {args.step_ms:g} ms\n"
        f"without verification: {plain:,.0f} tokens/s (runs {', '.join(f'{r:,.0f}' for r in runs[False])})\n"
        f"verifying each shard on first read: {verified:,.0f} tokens/s (runs {', '.join(f'{r:,.0f}' for r in runs[True])})\n"
        f"ratio: {verified / plain:.3f}",
        flush=True,
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    **vars(args),
                    "json": None,
                    "shards": shards,
                    "bytes": size,
                    "plain": runs[False],
                    "verified": runs[True],
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
