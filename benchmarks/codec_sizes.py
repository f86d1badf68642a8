"""Bytes per token and error of every codec, on random states at the 27B shape and on a real
target's states from a cache; and the encode's cost beside the target's forward on this CPU.

    PYTHONPATH=. python benchmarks/codec_sizes.py [--cache CACHE] [--target TARGET] [--tokens 6144]
        [--ranks 576,1152] [--random-ranks 1024,2048] [--json FILE]

1. random: `benchmarks/codecs.py`'s synthetic states [--tokens, 5 x 5120] (Gaussian, a scale per
   token, 8 massive channels). A subspace basis fitted on the first half of the tokens codes the
   second half (random states have no structure: their error shows only what k alone costs).
2. real (--cache, a bf16 or bf16-zstd cache): its first --tokens tokens, the basis fitted on the
   first half and the bytes and errors measured on the second half.
3. encode cost (--target, with --cache for its layers): the target's forward over one sequence of
   --forward-tokens tokens in bf16 on --device, beside each codec's encode of the captured states
   there (what extraction runs on the GPU), and the zstd of the encoded bytes on one host thread
   (which extraction overlaps with the next forwards on its compress threads).

Bytes per token count the stored payload and scales; share is of raw bf16 (2 bytes a value);
kept is the mean over the coded tokens' of the share of their sum of squares the basis keeps
(subspace.token_shares, measured on the fitting half); error is ||x - x'|| / ||x|| per token, x' the decoded states (for a subspace codec c' U^T), median
and 99th percentile over tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.codecs import synthetic_activations
from dflash_cache.store.codecs import CODECS, compress, decode, decompress, encode, encoded_size
from dflash_cache.store.subspace import fit_basis, gram, inner_groups, is_subspace, token_shares

ROUND = 64
GRAM_WIDTH = 8192


def codec_list(ranks: list[int]) -> list[tuple[str, str, int]]:
    """(label, codec, rank) for each codec; the subspace ones once per rank."""
    out = []
    for codec in CODECS:
        if not is_subspace(codec):
            out.append((codec, codec, 0))
            continue
        out += [(f"{codec} k={k}", codec, k) for k in ranks]
    return out


def measure(x: torch.Tensor, layers: int, codec: str, basis: torch.Tensor | None) -> dict:
    t = x.shape[0]
    enc = encode(x, codec, layers, basis)
    payload = compress(enc.planes.numpy(), codec)
    width = basis.shape[1] if basis is not None else x.shape[1]
    stored = payload.nbytes + (0 if enc.scales is None else enc.scales.numel() * 4)
    planes = decompress(payload, codec, encoded_size(codec, t, width))
    y = decode(torch.from_numpy(planes.copy()), enc.scales, codec, t, width).float()
    if basis is not None:
        y = y @ basis.T
    error = (y - x.float()).norm(dim=1) / x.float().norm(dim=1).clamp_min(1e-30)
    return {
        "bytes_per_token": stored / t,
        "share": stored / (2 * x.numel()),
        "error_median": float(error.median()),
        "error_p99": float(error.quantile(0.99)),
    }


def table(title: str, x: torch.Tensor, layers: int, ranks: list[int]) -> list[dict]:
    """Basis on the first half, everything measured on the second."""
    fit, test = x[: x.shape[0] // 2], x[x.shape[0] // 2 :]
    if x.shape[1] > GRAM_WIDTH:  # a [W, W] float64 Gram matrix would not fit this host: an SVD of the tokens
        vh = torch.linalg.svd(fit.float(), full_matrices=False).Vh
        fitted = lambda k: (vh[:k].T.contiguous(), float(token_shares(fit.split(512), vh[:k].T.float())[-1]))
    else:
        g = gram(fit.split(512), "cpu")[0]
        fitted = lambda k: fit_basis(g, k, 1.0, fit.split(512))
    print(f"\n{title}: [{x.shape[0]} tokens, {x.shape[1]} values]; the second half coded")
    print(f"{'codec':<28} {'bytes/token':>11} {'share':>6} {'kept':>7} {'error med':>10} {'error p99':>10}")
    rows = []
    for label, codec, k in codec_list(ranks):
        if k and (k > min(fit.shape) or k % ROUND or inner_groups(k) == 0):
            continue
        basis, kept = fitted(k) if k else (None, 1.0)
        row = {"input": title, "codec": label, "kept": kept, **measure(test, layers, codec, basis)}
        rows.append(row)
        print(
            f"{label:<28} {row['bytes_per_token']:>11,.0f} {row['share']:>6.3f} {kept:>7.4f} "
            f"{row['error_median']:>10.4f} {row['error_p99']:>10.4f}"
        )
    return rows


def cache_states(path: Path, tokens: int) -> tuple[torch.Tensor, int, dict]:
    from dflash_cache.store.cache import open_cache
    from dflash_cache.store.subspace import sample_chunks

    cache = open_cache(path)
    return torch.cat(list(sample_chunks(cache, tokens))), len(cache.spec["layer_ids"]), cache.spec


def timed(fn, device: str) -> tuple[float, object]:
    sync = torch.cuda.synchronize if device.startswith("cuda") else lambda: None
    sync()
    start = time.perf_counter()
    result = fn()
    sync()
    return time.perf_counter() - start, result


def encode_cost(target: Path, spec: dict, tokens: int, ranks: list[int], device: str) -> list[dict]:
    """The forward and each codec's encode on `device` (the GPU's work), then the copy to the host
    and zstd on one host thread, as extraction splits them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).to(device).eval()
    ids = torch.randint(0, spec["target"]["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    with torch.no_grad():
        model(ids, output_hidden_states=True)  # warm-up
        forward, out = timed(lambda: model(ids, output_hidden_states=True), device)
    x = torch.cat([out.hidden_states[i + 1][0] for i in spec["layer_ids"]], dim=-1)
    layers = len(spec["layer_ids"])
    g = gram([x], device)[0]
    print(f"\nencode on {device}: the forward of {tokens} tokens took {forward:.4f} s")
    print(f"{'codec':<28} {'encode s':>10} {'of the forward':>15} {'host zstd s':>12}")
    rows = []
    for label, codec, k in codec_list(ranks):
        if k and k > x.shape[1]:
            continue
        basis = fit_basis(g, k, 1.0)[0].to(device) if k else None
        encode(x, codec, layers, basis)  # warm-up
        seconds, enc = timed(lambda: encode(x, codec, layers, basis), device)
        planes = enc.planes.cpu().numpy()
        host, _ = timed(lambda: compress(planes, codec), "cpu")
        rows.append(
            {"codec": label, "encode_s": seconds, "forward_s": forward, "share": seconds / forward, "zstd_s": host}
        )
        print(f"{label:<28} {seconds:>10.4f} {seconds / forward:>15.3f} {host:>12.4f}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=Path, help="a bf16 or bf16-zstd cache of a real target")
    parser.add_argument("--target", type=Path, help="that target's folder, for the encode's cost")
    parser.add_argument("--tokens", type=int, default=6144)
    parser.add_argument("--forward-tokens", type=int, default=1024)
    parser.add_argument("--ranks", default="576,1152", help="subspace ranks on the real states")
    parser.add_argument("--random-ranks", default="1024,2048", help="subspace ranks on the random states")
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--device", default="cpu", help="where the forward and the encode run (cuda: a GPU)")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ranks = [int(k) for k in args.ranks.split(",")]
    rows = table(
        f"random states at [{args.layers} x {args.hidden}]",
        synthetic_activations(args.tokens, args.layers, args.hidden),
        args.layers,
        [int(k) for k in args.random_ranks.split(",")],
    )
    if args.cache:
        x, layers, spec = cache_states(args.cache, args.tokens)
        rows += table(f"{spec['target']['name']}'s states, layers {spec['layer_ids']}", x, layers, ranks)
        if args.target:
            rows += encode_cost(args.target, spec, args.forward_tokens, ranks, args.device)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
