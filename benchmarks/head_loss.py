"""The LM-head loss of one chunk: the Triton per-row kernel against the same math in torch, both compiled.

    PYTHONPATH=. python benchmarks/head_loss.py [--preset qwen3.6-27b] [--rows 1024] [--iters 20]

One chunk as the drafter's loss runs it (drafter/head_loss.py: `chunk_terms`, `reference_terms`):
states [rows, H] through the frozen bf16 head [V, H], loss, argmax and the gradient wrt the states,
each function compiled for static shapes as the compiled drafter runs it. Prints the mean milliseconds
of each, the matmuls' share (the two matmuls alone, timed the same way) and the largest differences
between the two results.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.profiling import cuda_mean_ms
from dflash_cache.drafter.config_file import load_drafter_config
from dflash_cache.drafter.head_loss import chunk_terms, reference_terms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3.6-27b")
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    config = load_drafter_config(args.preset)
    g = torch.Generator("cuda").manual_seed(0)
    h, v = config.hidden_size, config.vocab_size
    weight = (torch.randn(v, h, device="cuda", generator=g) * 0.02).bfloat16()
    states = torch.randn(args.rows, h, device="cuda", generator=g).bfloat16()
    labels = torch.randint(0, v, (args.rows,), device="cuda", generator=g)
    row_weights = torch.rand(args.rows, device="cuda", generator=g)
    matmuls = torch.compile(lambda: (states @ weight.T) @ weight)
    results = {}
    for name, terms in (("triton kernel", chunk_terms), ("torch (Inductor)", reference_terms), ("matmuls only", None)):
        fn = matmuls if terms is None else torch.compile(lambda t=terms: t(states, weight, labels, row_weights, True))
        ms = cuda_mean_ms(fn, args.iters)
        if terms is not None:
            results[name] = fn()
        print(f"{name:>17}: {ms:7.3f} ms per chunk of {args.rows} rows x {v} vocabulary", flush=True)
    (loss_a, pred_a, grad_a), (loss_b, pred_b, grad_b) = results.values()
    print(
        f"differences: per-row loss max |diff| {(loss_a - loss_b).abs().max().item():.2e} (of a mean of "
        f"{loss_b.mean().item():.3f}); argmax differs on "
        f"{(pred_a != pred_b).sum().item()} rows; gradient max |diff| {(grad_a - grad_b).abs().max().item():.2e}"
    )


if __name__ == "__main__":
    main()
