"""Flex-attention forward + backward on the drafter's own masks, per tile size and kernel options.

    PYTHONPATH=. python benchmarks/flex_configs.py [--preset qwen3.6-27b] [--tokens 16384] [--anchors 512]
                 [--tiles 128,64] [--options '{}' '{"USE_TMA": true}'] [--autotune] [--groups 1,4]

One decoder layer's attention of each kind (sliding, full) on the first batch of speculators 0.9.0's step script (benchmarks/drafter.py
`peer_batches`) at the preset's head counts and head size, bf16, compiled for static shapes as the compiled
drafter runs it. For each tile size and each kernel-options dict (flex_attention's `kernel_options`;
keys prefixed bwd_ apply to the backward), the mean forward and backward milliseconds over --iters.
--autotune adds Inductor's own search (max_autotune for flex-attention; matmuls stay on ATen), whose
choices and timings Inductor prints. --groups: each key head's query heads run apart (1) or packed into
its rows, as the drafter runs them (drafter/attention.py `attend`). --mask-mods: the BlockMask's mask function
in its interval form (masks.key_intervals) and/or as the rule (masks.visible). Every variant's output and gradients are compared with the first
variant's on the same inputs (the largest absolute difference; bf16 rounding alone gives about 1e-2).
benchmarks/mask_density.py gives the share of the computed tiles' pairs that are visible.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from torch.nn.attention.flex_attention import flex_attention

from benchmarks.drafter import add_step_shape_arguments, peer_batches
from dflash_cache.drafter.anchors import sample_anchors
from dflash_cache.drafter.config_file import load_drafter_config
from dflash_cache.drafter.inputs import DraftInputs
from dflash_cache.drafter.masks import BlockLayout, _ordered, block_mask, visible


def rule_mask_mod(layout: BlockLayout, window: int | None, group: int):
    """The mask function as the rule itself (masks.visible: three loads per key), which the drafter's
    BlockMasks ran before their interval form."""

    def mask_mod(b, h, q_idx, kv_idx):
        return visible(layout, q_idx // group, kv_idx, window)

    return mask_mod


def all_tiles_full(mask):
    """`mask` with every partial tile made a full one: the same tiles computed, none masked. Its outputs
    are wrong; its time is what the mask function and the partial tiles cost."""
    from torch.nn.attention.flex_attention import BlockMask

    tiles = mask.to_dense()[0, 0].bool()
    count, indices = _ordered(tiles)
    return BlockMask.from_kv_blocks(
        torch.zeros_like(count), indices, count, indices, BLOCK_SIZE=mask.BLOCK_SIZE, seq_lengths=mask.seq_lengths
    )


def time_config(
    q, k, v, mask, options: dict, compile_options: dict | None, iters: int, group: int
) -> tuple[float, float, list[torch.Tensor]]:
    """(mean forward ms, mean backward ms, [output, dq, dk, dv] of the first call). With `group` > 1 the
    query heads of each key head are packed into its rows (drafter/attention.py `attend`), and the
    times include the packing and unpacking copies."""
    torch._dynamo.reset()
    kernel = torch.compile(flex_attention, dynamic=False, options=compile_options)
    _, heads, queries, dim = q.shape
    key_heads = heads // group

    def run() -> torch.Tensor:
        if group == 1:
            return kernel(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=options or None)
        packed = q[0].view(key_heads, group, queries, dim).transpose(1, 2).reshape(1, key_heads, queries * group, dim)
        out = kernel(packed, k, v, block_mask=mask, kernel_options=options or None)
        return out[0].view(key_heads, queries, group, dim).transpose(1, 2).reshape(1, heads, queries, dim)

    grad = torch.randn(q.shape, device=q.device, dtype=q.dtype, generator=torch.Generator(q.device).manual_seed(1))
    for t in (q, k, v):
        t.grad = None
    out = run()
    out.backward(grad)
    results = [out.detach()] + [t.grad.clone() for t in (q, k, v)]
    run().backward(grad)
    fwd, bwd = [], []
    for _ in range(iters):
        e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        e[0].record()
        out = run()
        e[1].record()
        out.backward(grad)
        e[2].record()
        torch.cuda.synchronize()
        fwd.append(e[0].elapsed_time(e[1]))
        bwd.append(e[1].elapsed_time(e[2]))
    return sum(fwd) / iters, sum(bwd) / iters, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_shape_arguments(parser)
    parser.add_argument("--tiles", default="128,64")
    parser.add_argument("--options", nargs="*", default=["{}"], help="kernel_options dicts, as JSON")
    parser.add_argument("--autotune", action="store_true")
    parser.add_argument(
        "--groups",
        default="1,4",
        help="query rows per key head's query: 1 (each query head on its own) or the query heads a key "
        "head serves, packed (what the drafter runs)",
    )
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument(
        "--mask-mods",
        default="intervals",
        help="intervals (the BlockMask's own mask function, what the drafter runs), rule (rule_mask_mod) "
        "and/or unmasked (all_tiles_full: the same tiles with no mask; wrong outputs, for timing)",
    )
    args = parser.parse_args()
    config = load_drafter_config(args.preset)
    batch = peer_batches(config, args.tokens, "cuda", count=1)[0]
    anchors = sample_anchors(
        batch, config.block_size, args.anchors, torch.Generator("cuda").manual_seed(0), max_total=args.anchors
    )
    inputs = DraftInputs.build(batch, anchors)
    g = torch.Generator("cuda").manual_seed(0)
    nq, nkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    variants = [(json.loads(o), None, o) for o in args.options]
    groups = [int(g) for g in args.groups.split(",")]
    if args.autotune:
        variants.append(({}, {"max_autotune": True, "max_autotune_gemm_backends": "ATEN"}, "autotune"))
    for tile in (int(t) for t in args.tiles.split(",")):
        layout = BlockLayout.build(inputs.seq_ids, inputs.positions, inputs.anchors, config.block_size, tile)
        q = torch.randn(1, nq, layout.num_queries, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        k, v = (
            torch.randn(1, nkv, layout.num_keys, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in range(2)
        )
        for kind, window in (("sliding", config.sliding_window), ("full", None)):
            first = None
            for mod, group, (options, compile_options, name) in itertools.product(
                args.mask_mods.split(","), groups, variants
            ):
                mask = block_mask(layout, window, tile, group)
                if mod == "rule":
                    mask.mask_mod = rule_mask_mod(layout, window, group)
                elif mod == "unmasked":
                    mask = all_tiles_full(mask)
                name = f"{name} group {group} {mod}"
                try:
                    fwd, bwd, results = time_config(q, k, v, mask, options, compile_options, args.iters, group)
                    first = first or results
                    diff = "  max |diff| vs first: out/dq/dk/dv " + " ".join(
                        f"{(a.float() - b.float()).abs().max().item():.2e}" for a, b in zip(results, first)
                    )
                    print(f"tile {tile:>3} {kind:>7} {name:<40} fwd {fwd:6.2f} ms  bwd {bwd:6.2f} ms{diff}", flush=True)
                except Exception as error:  # a configuration Inductor refuses: say so and go on
                    print(
                        f"tile {tile:>3} {kind:>7} {name:<40} failed: {type(error).__name__}: {str(error)[:300]}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
