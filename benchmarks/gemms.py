"""Each matmul of the drafter's training step, timed alone, and the step's matmul floor.

    PYTHONPATH=. python benchmarks/gemms.py [--preset qwen3.6-27b] [--tokens 16384] [--anchors 512] [--iters 20]

The compiled step's matmuls at its padded shape (--tokens context tokens, --anchors blocks): for every
linear layer y = x W^T the forward x W^T, the input gradient dy W and the weight gradient dy^T x (the
first decoder layer's block input and the target states need no input gradient), and the frozen LM head's
forward and input gradient, a chunk of rows at a time as `drafter/head_loss.py` runs it. bf16, random
operands. Each matmul's mean time over --iters back-to-back calls, its TFLOP/s and its share of the
790 TFLOP/s that MFU uses; then the sum, which is what the step's matmuls would take if each ran as fast
as it does alone. Alternatives that change how the matmuls are cut (fused projections, larger head
chunks) are timed the same way and printed as the time they would save.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from benchmarks.drafter import add_step_shape_arguments
from benchmarks.profiling import cuda_mean_ms
from dflash_cache.drafter.config_file import load_drafter_config
from dflash_cache.drafter.head_loss import LOGITS_PER_CHUNK, chunk_sizes


@dataclass
class Linear:
    """x [rows, inputs] W^T, W [outputs, inputs], run `count` times a step."""

    name: str
    rows: int
    inputs: int
    outputs: int
    count: int = 1
    input_grad: bool = True
    weight_grad: bool = True

    def passes(self) -> list[tuple[str, int, int, int, int]]:
        """(pass, m, k, n, count) of its matmuls: [m, k] @ [k, n]."""
        out = [("forward", self.rows, self.inputs, self.outputs, self.count)]
        if self.input_grad:
            out.append(("input grad", self.rows, self.outputs, self.inputs, self.count))
        if self.weight_grad:
            out.append(("weight grad", self.outputs, self.rows, self.inputs, self.count))
        return out


def step_dims(config, anchors: int) -> tuple[int, ...]:
    """(hidden, intermediate, vocab, block queries, k/v width, layers, q/o width, LM-head rows)."""
    return (
        config.hidden_size,
        config.intermediate_size,
        config.vocab_size,
        anchors * config.block_size,
        config.num_key_value_heads * config.head_dim,
        config.num_hidden_layers,
        config.num_attention_heads * config.head_dim,
        anchors * (config.block_size - 1),
    )


def step_linears(config, tokens: int, anchors: int) -> list[Linear]:
    h, i, v, q, kv, layers, qo, head_rows = step_dims(config, anchors)
    linears = [Linear("fc", tokens, len(config.target_layer_ids) * config.target_hidden_size, h, input_grad=False)]
    for name, rows, inputs, outputs in [("q_proj", q, h, qo), ("k_proj block", q, h, kv), ("v_proj block", q, h, kv)]:
        linears += [
            Linear(name, rows, inputs, outputs, layers - 1),
            Linear(name + " (layer 0)", rows, inputs, outputs, 1, False),
        ]
    linears += [
        Linear("k_proj context", tokens, h, kv, layers),
        Linear("v_proj context", tokens, h, kv, layers),
        Linear("o_proj", q, qo, h, layers),
        Linear("gate_proj", q, h, i, layers),
        Linear("up_proj", q, h, i, layers),
        Linear("down_proj", q, i, h, layers),
    ]
    for rows in chunk_sizes(head_rows, max(1, LOGITS_PER_CHUNK // v)):
        linears.append(Linear(f"lm_head chunk {rows}", rows, h, v, weight_grad=False))
    return linears


def alternatives(config, tokens: int, anchors: int) -> dict[str, tuple[list[Linear], list[Linear]]]:
    """name -> (the step's matmuls it replaces, the matmuls it runs instead). Merging the context's and
    the block's k and v projections gives the first layer's block rows an input gradient they do not need."""
    h, i, v, q, kv, layers, qo, head_rows = step_dims(config, anchors)
    base = step_linears(config, tokens, anchors)
    picks = lambda *prefixes: [linear for linear in base if linear.name.startswith(prefixes)]  # noqa: E731
    heads = picks("lm_head")
    return {
        "q, k, v of the block as one matmul": (
            picks("q_proj", "k_proj block", "v_proj block"),
            [
                Linear("qkv block", q, h, qo + 2 * kv, layers - 1),
                Linear("qkv block (layer 0)", q, h, qo + 2 * kv, 1, False),
            ],
        ),
        "k, v of context and block as one matmul each": (
            picks("k_proj block", "v_proj block", "k_proj context", "v_proj context"),
            [Linear("k_proj all", tokens + q, h, kv, layers), Linear("v_proj all", tokens + q, h, kv, layers)],
        ),
        "k and v of context and block as one matmul": (
            picks("k_proj block", "v_proj block", "k_proj context", "v_proj context"),
            [Linear("kv all", tokens + q, h, 2 * kv, layers)],
        ),
        "gate and up as one matmul": (picks("gate_proj", "up_proj"), [Linear("gate_up", q, h, 2 * i, layers)]),
        "LM head in chunks of 2048 rows": (
            heads,
            [Linear(f"lm_head chunk {r}", r, h, v, weight_grad=False) for r in chunk_sizes(head_rows, 2048)],
        ),
        "LM head in one chunk": (heads, [Linear("lm_head", head_rows, h, v, weight_grad=False)]),
    }


def time_matmul(m: int, k: int, n: int, iters: int, cache: dict) -> float:
    if (m, k, n) not in cache:
        g = torch.Generator("cuda").manual_seed(0)
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16, generator=g)
        cache[(m, k, n)] = cuda_mean_ms(lambda: a @ b, iters)
        del a, b
    return cache[(m, k, n)]


def total_ms(linears: list[Linear], iters: int, cache: dict, peak: float, show: bool = False) -> float:
    total = 0.0
    for linear in linears:
        for kind, m, k, n, count in linear.passes():
            ms = time_matmul(m, k, n, iters, cache)
            total += ms * count
            if show:
                tflops = 2 * m * k * n / ms / 1e9
                print(
                    f"{linear.name:>22} {kind:>11}  [{m:>6} x {k:>6}] @ [{k:>6} x {n:>6}]  x{count}  "
                    f"{ms:7.3f} ms  {tflops:5.0f} TFLOP/s  {tflops / peak:6.1%}",
                    flush=True,
                )
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_shape_arguments(parser)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--peak-tflops", type=float, default=790.0)
    args = parser.parse_args()
    config = load_drafter_config(args.preset)
    cache: dict = {}
    linears = step_linears(config, args.tokens, args.anchors)
    total = total_ms(linears, args.iters, cache, args.peak_tflops, show=True)
    flops = sum(2 * m * k * n * count for linear in linears for _, m, k, n, count in linear.passes())
    print(
        f"step's matmuls, each alone: {total:.1f} ms for {flops / 1e12:.1f} TFLOP = {flops / total / 1e9:.0f} TFLOP/s "
        f"({flops / total / 1e9 / args.peak_tflops:.1%} of {args.peak_tflops:.0f})",
        flush=True,
    )
    for name, (old, new) in alternatives(config, args.tokens, args.anchors).items():
        before, after = (
            total_ms(old, args.iters, cache, args.peak_tflops),
            total_ms(new, args.iters, cache, args.peak_tflops),
        )
        print(f"{name}: {before:.2f} -> {after:.2f} ms a step ({before - after:+.2f} saved)", flush=True)


if __name__ == "__main__":
    main()
