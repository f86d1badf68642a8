"""For the next session (not run yet): the LM head's loss for one step's rows with the logits matmul as
cuBLAS runs it (main) against a matmul compiled on its own with Inductor's autotuning, where call 2 found
a persistent-TMA Triton template at 3.30-3.32 ms a chunk against cuBLAS's 3.42-3.69.

    PYTHONPATH=. python benchmarks/results/2026-12-03-session20/next/head_logits.py [--rounds 5] [--iters 5]

One step's 7,680 rows (512 blocks x 15) of the 27B drafter in chunks of 1024, the head's weight random
bf16 [248,320, 5120]: head_loss.head_cross_entropy with main's chunk_terms, and with chunk_terms whose
logits come from the tuned matmul (the input gradient stays on cuBLAS, which won its tuning). Medians of
interleaved rounds, ms a step; the loss, predictions and gradient compared with main's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflash_cache.drafter import head_loss
from dflash_cache.drafter.head_loss import head_cross_entropy


def tuned_chunk_terms(matmul):
    def terms(states, weight, labels, row_weights, with_grad):
        scale = row_weights.float()
        logits = matmul(states.to(weight.dtype), weight)
        nll, predictions, grad = head_loss.row_terms(logits, labels, scale, with_grad)
        return (nll * scale).sum(), predictions, grad @ weight if with_grad else None
    return terms


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=7680)
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--vocab", type=int, default=248320)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    g = torch.Generator("cuda").manual_seed(0)
    weight = (torch.randn(args.vocab, args.hidden, device="cuda", generator=g) * 0.02).bfloat16()
    states = torch.randn(args.rows, args.hidden, device="cuda", generator=g).bfloat16().requires_grad_()
    labels = torch.randint(0, args.vocab, (args.rows,), device="cuda", generator=g)
    row_weights = torch.rand(args.rows, device="cuda", generator=g) / args.rows

    options = {"max_autotune_gemm": True, "triton.enable_persistent_tma_matmul": True}
    tuned = torch.compile(lambda a, w: a @ w.T, dynamic=False, options=options)
    variants = {"cuBLAS (main)": head_loss.chunk_terms, "tuned Triton logits": tuned_chunk_terms(tuned)}

    def run(terms):
        states.grad = None
        loss, predictions = head_cross_entropy(states, weight, labels, row_weights, chunk_rows=1024, terms=terms)
        loss.backward()
        return loss.detach(), predictions, states.grad

    reference = None
    for name, terms in variants.items():
        start = time.perf_counter()
        loss, predictions, grad = run(terms)
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        if reference is None:
            reference = (loss, predictions, grad.clone())
        print(f"{name}: first call {first:.1f} s; loss {loss.item():.6f} (main {reference[0].item():.6f}), "
              f"predictions equal {bool((predictions == reference[1]).all())}, "
              f"gradient max |difference| {(grad.float() - reference[2].float()).abs().max().item():.3g}", flush=True)
    times = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, terms in variants.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.iters):
                run(terms)
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) * 1e3 / args.iters)
    for name, ts in times.items():
        print(f"{name:>22}: {statistics.median(ts):7.3f} ms a step (median of {args.rounds}); rounds "
              + " ".join(f"{t:.3f}" for t in ts))


if __name__ == "__main__":
    main()
