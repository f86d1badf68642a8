"""Cache-fed against memory-fed drafter training, and peak memory over many steps of varying shape.

    PYTHONPATH=. python benchmarks/train.py [--preset qwen3.6-27b] [--batches 12] [--steps 24]
                                            [--memory-steps 1000] [--json FILE]

1. A synthetic bf16-zstd cache shaped like a Qwen3.6-27B target (5 layers x hidden 5120; samples of
   1000-4000 tokens) is written to local disk through the real shard writer, and planned into
   --batches batches of about --tokens tokens. The same batches then feed the same eager drafter
   step (as in benchmarks/drafter.py) (a) from the cache through the prefetching loader (threads read,
   verify and decompress into pinned memory; side-stream copy; decode on the GPU) and (b) from the
   same batches already decoded on the GPU (MemorySource). Both run --steps steps (cycling over the
   batches; the second pass reads from the page cache) after 3 warm-up steps. Also printed: the time
   per step the training thread spent in next() of each source, and the loader's tokens/s with no
   training beside it (the pass that puts the batches on the GPU for (b)): whether the host keeps up.
2. Peak GPU memory at step 100 and at step --memory-steps of an eager run whose batches change shape
   every step (lengths drawn at random), for a small drafter (hidden 1024, 2 layers) so that a thousand
   steps fit the time: a leak or a per-shape buffer cache would show as growth.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from benchmarks.drafter import peer_batches, random_drafter, train_step
from dflash_cache.data.plan import plan_batches
from dflash_cache.drafter.anchors import sample_anchors
from dflash_cache.drafter.config_file import load_drafter_config
from dflash_cache.drafter.runner import DrafterRunner
from dflash_cache.store.codecs import compress, encode
from dflash_cache.store.manifest import build_manifest, read_journals, write_manifest
from dflash_cache.store.schema import Row
from dflash_cache.store.writer import ShardWriter
from dflash_cache.stream.batch import FeatureBatch
from dflash_cache.stream.caches import CacheSet
from dflash_cache.stream.loader import Loader
from dflash_cache.stream.memory import MemorySource


def write_cache(root: Path, config, total_tokens: int, device: str, shard_bytes: int = 1 << 30) -> None:
    spec = {
        "target": {
            "name": "synthetic",
            "model_type": "qwen3_5_text",
            "config_hash": "",
            "num_layers": config.num_target_layers,
            "hidden_size": config.target_hidden_size,
            "vocab_size": config.vocab_size,
        },
        "layer_ids": config.target_layer_ids,
        "codec": "bf16-zstd",
        "hidden_dtype": "bfloat16",
        "tokenizer_hash": "",
        "data_hash": "",
        "max_length": 8192,
        "topk": 0,
    }
    g = torch.Generator().manual_seed(0)
    writer = ShardWriter(root, 0, spec, max_shard_bytes=shard_bytes)
    width = len(config.target_layer_ids) * config.target_hidden_size

    def row(sample_id: int, n: int) -> Row:
        gen = torch.Generator(device=device).manual_seed(sample_id)
        hidden = torch.randn(n, width, generator=gen, device=device).bfloat16()
        planes = encode(hidden, "bf16-zstd", len(config.target_layer_ids)).planes.cpu().numpy()
        rng = np.random.default_rng(sample_id)
        mask = np.ones(n, dtype=bool)
        mask[: int(n * 0.2)] = False
        return Row(
            sample_id,
            rng.integers(0, config.vocab_size - 1, n).astype(np.int32),
            mask,
            rng.integers(0, config.vocab_size - 1, n).astype(np.int32),
            compress(planes, "bf16-zstd"),
        )

    lengths, tokens = [], 0
    while tokens < total_tokens:
        lengths.append(int(torch.randint(1000, 4001, (1,), generator=g)))
        tokens += lengths[-1]
    with ThreadPoolExecutor(8) as pool:
        for r in pool.map(row, range(len(lengths)), lengths):
            writer.append(r)
    writer.commit()
    write_manifest(root, build_manifest(read_journals(root)))


def make_step(config, device: str):
    model, optimizer = random_drafter(config, device)
    runner = DrafterRunner(model)
    g = torch.Generator(device=device).manual_seed(0)

    def step(batch: FeatureBatch, anchors_per_batch: int) -> None:
        anchors = sample_anchors(batch, config.block_size, anchors_per_batch, g, max_total=anchors_per_batch)
        train_step(runner, model, optimizer, batch, anchors, device)

    return step


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(step, source, steps: int, anchors: int, device: str) -> tuple[float, float]:
    """(tokens/s, seconds per step the training thread spent in next(source))."""
    it = iter(source)
    for _ in range(3):
        step(next(it), anchors)
    sync(device)
    start, tokens, in_next = time.perf_counter(), 0, 0.0
    for _ in range(steps):
        asked = time.perf_counter()
        batch = next(it)
        in_next += time.perf_counter() - asked
        tokens += batch.num_tokens
        step(batch, anchors)
    sync(device)
    return tokens / (time.perf_counter() - start), in_next / steps


def run_parser(doc: str) -> argparse.ArgumentParser:
    """The options of a cache-fed training benchmark (this one and train_remote.py)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3.6-27b")
    parser.add_argument("--tokens", type=int, default=16384, help="token budget per batch")
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", type=Path)
    return parser


def main() -> None:
    parser = run_parser(__doc__)
    parser.add_argument("--memory-steps", type=int, default=1000)
    args = parser.parse_args()
    device = args.device
    config = load_drafter_config(args.preset)
    root = Path(tempfile.mkdtemp(prefix="bench-train-")) / "cache"
    started = time.perf_counter()
    write_cache(root, config, args.batches * args.tokens, device)
    caches = CacheSet([root])
    keys = list(range(len(caches.lengths)))
    batches = plan_batches(keys, caches.lengths, args.tokens, seed=0)[: args.batches]
    stored = sum(s.bytes for s in caches.caches[0].shards)
    print(
        f"cache: {len(keys)} samples, {sum(caches.lengths)} tokens, {stored / 1e9:.2f} GB on disk, written in {time.perf_counter() - started:.0f} s; "
        f"{len(batches)} batches, {args.steps} timed steps each run",
        flush=True,
    )

    step = make_step(config, device)
    cycle = (batches * (args.steps // len(batches) + 2))[: args.steps + 3]
    with Loader(caches, cycle, device, prefetch=4, workers=args.workers) as loader:
        cache_tok_s, cache_next_s = timed(step, loader, args.steps, args.anchors, device)
    # The same loader with no training beside it: what the host (and the copy) can deliver.
    started = time.perf_counter()
    with Loader(caches, batches, device, prefetch=4, workers=args.workers) as loader:
        on_gpu = list(loader)
    sync(device)
    loader_tok_s = sum(b.num_tokens for b in on_gpu) / (time.perf_counter() - started)
    memory_tok_s, memory_next_s = timed(step, MemorySource(on_gpu, args.steps + 3), args.steps, args.anchors, device)
    del on_gpu
    print(
        f"cache-fed:  {cache_tok_s:,.0f} tokens/s ({cache_next_s * 1e3:.1f} ms per step in next())\n"
        f"memory-fed: {memory_tok_s:,.0f} tokens/s ({memory_next_s * 1e3:.1f} ms per step in next())\n"
        f"ratio:      {cache_tok_s / memory_tok_s:.3f}\n"
        f"loader alone, {args.workers} workers: {loader_tok_s:,.0f} tokens/s "
        f"({loader_tok_s * caches.width * 2 / 1e9:.2f} GB/s of decompressed planes)",
        flush=True,
    )

    small = replace(
        config,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        layer_types=["sliding_attention", "full_attention"],
        vocab_size=32000,
        mask_token_id=31999,
        target_hidden_size=1024,
        sliding_window=config.sliding_window or 2048,
    )
    small_step = make_step(small, device)
    # One batch's worth of random tensors on the device; each step takes a prefix of random length
    # and its own sample boundaries, so every step has a new shape.
    pool = peer_batches(small, args.tokens, device, count=1)[0]
    peaks = {}
    g = torch.Generator().manual_seed(1)
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    for k in range(1, args.memory_steps + 1):
        n = int(torch.randint(2048, pool.num_tokens + 1, (1,), generator=g))
        cuts = torch.sort(torch.randint(1, n, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g)).values
        cu = torch.unique(torch.cat([torch.tensor([0]), cuts, torch.tensor([n])])).int().to(device)
        small_step(
            FeatureBatch(
                list(range(len(cu) - 1)),
                pool.input_ids[:n],
                pool.loss_mask[:n],
                pool.target_ids[:n],
                pool.hidden[:n],
                cu,
            ),
            args.anchors,
        )
        if k in (100, args.memory_steps):
            sync(device)
            peaks[k] = torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else 0.0
    print(
        f"peak GPU memory, small drafter, varying shapes: step 100 {peaks[100]:.3f} GB, step {args.memory_steps} {peaks[args.memory_steps]:.3f} GB "
        f"({(peaks[args.memory_steps] / max(peaks[100], 1e-9) - 1) * 100:+.2f}%)",
        flush=True,
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "cache_tok_s": cache_tok_s,
                    "memory_tok_s": memory_tok_s,
                    "ratio": cache_tok_s / memory_tok_s,
                    "cache_next_s": cache_next_s,
                    "memory_next_s": memory_next_s,
                    "loader_tok_s": loader_tok_s,
                    "stored_gb": stored / 1e9,
                    "peak_gb": peaks,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
