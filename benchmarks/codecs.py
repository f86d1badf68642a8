"""Bytes per value and single-core encode/decode speed of each codec on activation-like data.

    python benchmarks/codecs.py [--tokens 2048] [--hidden 4096] [--layers 5] [--activations FILE.safetensors]

Without --activations the data are synthetic (Gaussian with a few massive outlier channels and a
per-token scale), which compresses differently from real activations: the figures in BENCHMARKS.md
say which input they came from.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from dflash_cache.store.codecs import CODECS, SUBSPACE_CODECS, compress, decode, decompress, encode, encoded_size


def synthetic_activations(tokens: int, layers: int, hidden: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, layers, hidden, generator=g)
    x *= torch.rand(tokens, layers, 1, generator=g) * 2 + 0.5
    x[:, :, torch.randperm(hidden, generator=g)[:8]] *= 50.0
    return x.reshape(tokens, layers * hidden).bfloat16()


def best_of(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="also time compression on this many threads")
    parser.add_argument("--activations", help="safetensors file with a bf16 tensor 'hidden' [T, L*H]")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.activations:
        from safetensors.torch import load_file

        x = load_file(args.activations)["hidden"]
        layers = args.layers
        source = args.activations
    else:
        x, layers, source = synthetic_activations(args.tokens, args.layers, args.hidden), args.layers, "synthetic"
    t, width = x.shape
    raw_mb = x.numel() * 2 / 1e6
    print(f"input: {source}, [{t}, {width}] bf16, {raw_mb:.1f} MB; one core (MB/s of raw bf16)")
    print(
        f"{'codec':<10} {'bytes/value':>11} {'ratio':>6} {'encode MB/s':>12} {'decode MB/s':>12} {f'compress x{args.threads} MB/s':>18}"
    )
    for codec in (c for c in CODECS if c not in SUBSPACE_CODECS):  # those need a basis: codec_sizes.py
        enc = encode(x, codec, layers)
        planes = enc.planes.numpy()
        data = compress(planes, codec)
        size = encoded_size(codec, t, width)
        t_enc = best_of(lambda: compress(encode(x, codec, layers).planes.numpy(), codec))
        t_dec = best_of(
            lambda: decode(torch.from_numpy(decompress(data, codec, size).copy()), enc.scales, codec, t, width)
        )
        chunks = np.array_split(planes, args.threads)
        with ThreadPoolExecutor(args.threads) as pool:
            t_par = best_of(lambda: list(pool.map(lambda c: compress(c, codec), chunks)))
        extra = 0 if enc.scales is None else enc.scales.numel() * 4
        per_value = (len(data) + extra) / x.numel()
        print(
            f"{codec:<10} {per_value:>11.3f} {per_value / 2:>6.3f} {raw_mb / t_enc:>12.0f} {raw_mb / t_dec:>12.0f} {raw_mb / t_par:>18.0f}"
        )


if __name__ == "__main__":
    main()
