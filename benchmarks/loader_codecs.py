"""Whether one host keeps three training ranks fed, codec by codec, at the 27B shape.

    PYTHONPATH=. python benchmarks/loader_codecs.py [--layers 5] [--hidden 5120] [--tokens 8192]
        [--rank 1024] [--ranks 3] [--rank-rate 65000] [--codecs fp4,subspace-fp8-zstd] [--json FILE]

For each codec a cache of --tokens tokens of activation-like states (benchmarks/codecs.py's synthetic
ones: Gaussian, a per-token scale, 8 massive channels; the subspace codecs on a random orthonormal
basis of --rank columns) is written to a temporary folder and read from the page cache. Timed on
one thread (torch on one thread too):

1. host: `loader.fill_row` over every row (read, checksum, decompress into the batch's buffers):
   what the loader's reader threads do on the host; the arithmetic of decoding runs on the GPU.
2. host+decode: the same, then `loader.to_device(..., "cpu")`: the decode on this CPU too, for a
   host that would decode without a GPU.

Printed per codec: stored bytes per token, tokens/s on one core for each, and the cores one host
needs to feed --ranks ranks of --rank-rate tokens/s each (the drafter step's rate at the 27B shape)
when the GPU decodes. The second pass of two is timed (the first warms the page cache).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.codecs import synthetic_activations
from dflash_cache.store.codecs import CODECS, compress, encode
from dflash_cache.store.manifest import build_manifest, read_journals, write_manifest
from dflash_cache.store.schema import Row
from dflash_cache.store.subspace import is_subspace
from dflash_cache.store.writer import ShardWriter
from dflash_cache.stream.caches import CacheSet
from dflash_cache.stream.loader import empty_host_batch, fill_row, to_device

ROW_TOKENS = 2048


def spec_for(codec: str, layers: int, hidden: int, rank: int) -> dict:
    spec = {
        "target": {
            "name": "synthetic",
            "model_type": "qwen3_5_text",
            "config_hash": "",
            "num_layers": 64,
            "hidden_size": hidden,
            "vocab_size": 1000,
        },
        "layer_ids": list(range(1, 1 + layers)),
        "codec": codec,
        "hidden_dtype": "bfloat16",
        "tokenizer_hash": "",
        "data_hash": "",
        "max_length": 8192,
        "topk": 0,
    }
    if is_subspace(codec):
        spec["subspace"] = {"rank": rank, "sha256": ""}
    return spec


def write(root: Path, spec: dict, tokens: int, basis: torch.Tensor | None) -> int:
    """Writes the cache; returns its stored hidden bytes (payloads and scales)."""
    writer = ShardWriter(root, 0, spec, max_shard_bytes=1 << 30)
    layers, stored = len(spec["layer_ids"]), 0
    for sample_id, start in enumerate(range(0, tokens, ROW_TOKENS)):
        n = min(ROW_TOKENS, tokens - start)
        hidden = synthetic_activations(n, layers, spec["target"]["hidden_size"], seed=sample_id)
        enc = encode(hidden, spec["codec"], layers, basis)
        payload = compress(enc.planes.numpy(), spec["codec"])
        scales = None if enc.scales is None else enc.scales.numpy().tobytes()
        stored += payload.nbytes + (len(scales) if scales else 0)
        ids = np.zeros(n, dtype=np.int32)
        writer.append(Row(sample_id, ids, np.ones(n, dtype=bool), ids, payload, scales))
    writer.commit()
    write_manifest(root, build_manifest(read_journals(root)))
    return stored


def rates(root: Path) -> tuple[float, float]:
    """(host tokens/s, host+decode tokens/s) on one thread, the second pass of two each."""
    caches = CacheSet([root])
    keys = list(range(len(caches)))
    batch = empty_host_batch(caches, keys, pin=False)
    result = []
    for decode in (False, True):
        for _ in range(2):
            start = time.perf_counter()
            for i in range(len(keys)):
                fill_row(caches, batch, i)
            if decode:
                to_device(batch, caches.codec, caches.width, torch.device("cpu"))
            seconds = time.perf_counter() - start
        result.append(batch.offsets[-1] / seconds)
    return result[0], result[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rank", type=int, default=1024, help="subspace codecs' coordinates")
    parser.add_argument("--ranks", type=int, default=3, help="training ranks one host feeds")
    parser.add_argument("--rank-rate", type=float, default=65000, help="tokens/s one rank consumes")
    parser.add_argument("--codecs", default=",".join(CODECS))
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    width = args.layers * args.hidden
    basis = torch.linalg.qr(torch.randn(width, args.rank, generator=torch.Generator().manual_seed(0)))[0]
    need = args.ranks * args.rank_rate
    print(
        f"[{args.layers} x {args.hidden}] states, {args.tokens} tokens a codec, one thread; "
        f"{args.ranks} ranks x {args.rank_rate:,.0f} tokens/s = {need:,.0f} tokens/s to feed"
    )
    print(f"{'codec':<20} {'bytes/token':>11} {'share':>6} {'host tok/s':>11} {'+decode tok/s':>14} {'cores':>6}")
    results = []
    for codec in args.codecs.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            spec = spec_for(codec, args.layers, args.hidden, args.rank)
            stored = write(Path(tmp), spec, args.tokens, basis if is_subspace(codec) else None)
            host, decoded = rates(Path(tmp))
        per_token = stored / args.tokens
        cores = math.ceil(need / host)
        results.append(
            {"codec": codec, "bytes_per_token": per_token, "host_tok_s": host, "decode_tok_s": decoded, "cores": cores}
        )
        print(
            f"{codec:<20} {per_token:>11,.0f} {per_token / (2 * width):>6.3f} {host:>11,.0f} {decoded:>14,.0f} {cores:>6}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
