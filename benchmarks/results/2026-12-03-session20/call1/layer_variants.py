"""Session 20, call 1: one decoder layer of the 27B drafter, forward + backward compiled as the compiled
drafter runs it (static shapes, bf16 autocast, bf16 matrices, the peer's first batch padded to 16,400
tokens and 512 anchors), in variants of the model code and of Inductor's options, side by side.

    PYTHONPATH=. python layer_variants.py [--variants base,rope_table,fused_qkv,fused_mlp,...] [--rounds 5]

Variants (monkeypatched here; the layer's weights are the same in each):
  base        the model as on main
  rope_table  cos/sin tables from an opaque custom op, so that Inductor reads them instead of computing
              sin and cos in every kernel that rotates q or k (forward and the recomputed backward)
  fused_qkv   one matmul for q, k, v of the block rows and one for k, v of the context rows, over the
              three weights concatenated each forward
  fused_mlp   one matmul for gate and up over the two weights concatenated each forward
  flip_rotate the half swap of rotary as a flip of a [2, D/2] view times [-1, 1], not a cat of two slices
  strided_kv  k and v handed to flex-attention as strided views, not copied into [1, H, T, D]
  cdt         base compiled with coordinate_descent_tuning (Inductor tunes its own kernels' launch options)
  nomix       base compiled with triton.mix_order_reduction off
Each variant's output and gradients are compared with base's (largest absolute difference).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.drafter import peer_batches
from dflash_cache.drafter import model as model_module
from dflash_cache.drafter.anchors import sample_anchors
from dflash_cache.drafter.attention import attend
from dflash_cache.drafter.config import load_drafter_config
from dflash_cache.drafter.inputs import DraftInputs
from dflash_cache.drafter.masks import BatchMasks, BlockLayout


@torch.library.custom_op("session20::rotary_tables", mutates_args=())
def rotary_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    angles = positions.float()[:, None] * inv_freq.float()[None, :]
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


@rotary_tables.register_fake
def _(positions, inv_freq, dtype):
    shape = (positions.shape[0], 1, 2 * inv_freq.shape[0])
    return positions.new_empty(shape, dtype=dtype), positions.new_empty(shape, dtype=dtype)


def rope_table_forward(self, positions, dtype):
    return rotary_tables(positions, self.inv_freq, dtype)


def flip_rotate(x, rope):
    """rotate() with the half swap as a flip of a [2, D/2] view times [-1, 1]: one load per element,
    where the cat of two slices loads each half under a mask."""
    cos, sin = rope
    halves = x.unflatten(-1, (2, -1))
    sign = torch.tensor([-1.0, 1.0], device=x.device, dtype=x.dtype)[:, None]
    return x * cos + (halves.flip(-2) * sign).flatten(-2) * sin


def fused_qkv_forward(self, x, context, rope_q, rope_kv, mask):
    heads = lambda t: t.unflatten(-1, (-1, self.head_dim))  # noqa: E731
    nq, nkv = self.q_proj.out_features, self.k_proj.out_features
    weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
    q, k_block, v_block = F.linear(x, weight).split([nq, nkv, nkv], dim=-1)
    k_context, v_context = F.linear(context, weight[nq:]).split([nkv, nkv], dim=-1)
    q = self.q_norm(heads(q))
    k = self.k_norm(heads(torch.cat([k_context, k_block])))
    v = heads(torch.cat([v_context, v_block]))
    q, k = model_module.rotate(q, rope_q), model_module.rotate(k, rope_kv)
    return self.o_proj(attend(q, k, v, mask).flatten(1))


def strided_attend(q, k, v, mask):
    """attention.attend with k and v handed to flex-attention as strided views ([T, H, D] transposed),
    not copied into [1, H, T, D]."""
    from dflash_cache.drafter.attention import KERNEL_OPTIONS, flex_attention
    if isinstance(mask, torch.Tensor):  # the CPU smoke test's dense mask
        return attend(q, k, v, mask)
    queries, heads, dim = q.shape
    key_heads = k.shape[1]
    group = heads // key_heads
    packed = q.view(queries, key_heads, group, dim).permute(1, 0, 2, 3).reshape(1, key_heads, queries * group, dim)
    out = flex_attention(packed, k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=mask,
                         kernel_options=KERNEL_OPTIONS)
    return out.view(key_heads, queries, group, dim).permute(1, 0, 2, 3).reshape(queries, heads, dim)


def fused_mlp_forward(self, x):
    gate, up = F.linear(x, torch.cat([self.gate_proj.weight, self.up_proj.weight])).chunk(2, dim=-1)
    return self.down_proj(F.silu(gate) * up)


ORIGINAL_ROTATE = model_module.rotate
ORIGINAL = {
    "rotary": model_module.Rotary.forward,
    "attention": model_module.Attention.forward,
    "mlp": model_module.MLP.forward,
}
PATCHES = {"rope_table": ("rotary", rope_table_forward), "fused_qkv": ("attention", fused_qkv_forward),
           "fused_mlp": ("mlp", fused_mlp_forward)}
OPTIONS = {"cdt": {"coordinate_descent_tuning": True}, "nomix": {"triton.mix_order_reduction": False}}
CLASSES = {"rotary": model_module.Rotary, "attention": model_module.Attention, "mlp": model_module.MLP}


def apply(variant: str) -> dict | None:
    for name, fn in ORIGINAL.items():
        setattr(CLASSES[name], "forward", fn)
    model_module.rotate = flip_rotate if "flip_rotate" in variant.split("+") else ORIGINAL_ROTATE
    model_module.attend = strided_attend if "strided_kv" in variant.split("+") else attend
    for part in variant.split("+"):
        if part in PATCHES:
            name, fn = PATCHES[part]
            setattr(CLASSES[name], "forward", fn)
    options = {}
    for part in variant.split("+"):
        options.update(OPTIONS.get(part, {}))
    return options or None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="base,rope_table,fused_qkv,fused_mlp,rope_table+fused_qkv+fused_mlp,cdt,nomix")
    parser.add_argument("--kind", default="sliding_attention")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--code", action="store_true", help="log Inductor's output code of the first variant")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="qwen3.6-27b")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--anchors", type=int, default=512)
    args = parser.parse_args()
    device = args.device
    cpu = device == "cpu"  # a smoke test: dense mask, aot_eager
    sync = (lambda: None) if cpu else torch.cuda.synchronize
    config = load_drafter_config(args.preset)
    batch = peer_batches(config, args.tokens, device, count=1)[0]
    g = torch.Generator(device=device).manual_seed(0)
    anchors = sample_anchors(batch, config.block_size, args.anchors, g, max_total=args.anchors)
    inputs = DraftInputs.build(batch, anchors).padded(args.tokens, args.anchors, config.block_size)
    group = config.num_attention_heads // config.num_key_value_heads
    layout = BlockLayout.build(inputs.seq_ids, inputs.positions, inputs.anchors, config.block_size, 128)
    mask = BatchMasks.build(layout, config.layer_types, config.sliding_window, cpu, 128, group).by_type[args.kind]

    torch.manual_seed(0)
    layer = model_module.DecoderLayer(config).to(device)
    for module in layer.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.02)
    for p in layer.parameters():
        if p.dim() >= 2:
            p.data = p.data.bfloat16()
    rotary = model_module.Rotary(config.head_dim, config.rope_theta).to(device)
    n, q = inputs.positions.shape[0], layout.num_queries
    x = (torch.randn(q, config.hidden_size, device=device) * 0.5).bfloat16().requires_grad_()
    context = (torch.randn(n, config.hidden_size, device=device) * 0.5).bfloat16().requires_grad_()
    grad_out = torch.randn(q, config.hidden_size, device=device).bfloat16()
    block_positions = layout.q_pos[:q]
    kv_positions = torch.cat([inputs.positions, block_positions])

    def forward(x, context):
        rope_q = rotary(block_positions, torch.bfloat16)
        rope_kv = rotary(kv_positions, torch.bfloat16)
        return layer(x, context, rope_q, rope_kv, mask)

    def run(fn):
        layer.zero_grad(set_to_none=True)
        x.grad = context.grad = None
        with torch.autocast(device, dtype=torch.bfloat16):
            out = fn(x, context)
        out.backward(grad_out)
        return out

    compiled, reference = {}, None
    for variant in args.variants.split(","):
        options = apply(variant)
        torch._dynamo.reset()
        if args.code and reference is None:
            torch._logging.set_logs(output_code=True)
        fn = torch.compile(forward, dynamic=False, backend="aot_eager" if cpu else "inductor",
                           options=None if cpu else options)
        compiled[variant] = fn
        t0 = time.perf_counter()
        out = run(fn)
        sync()
        first_s = time.perf_counter() - t0
        torch._logging.set_logs(output_code=False)
        grads = [out.detach().float(), x.grad.float(), context.grad.float()] + [p.grad.float() for p in layer.parameters()]
        if reference is None:
            reference = grads
            diff = 0.0
        else:
            diff = max((a - b).abs().max().item() for a, b in zip(grads, reference))
        print(f"{variant}: first call (compile) {first_s:.1f} s; max |difference| from {args.variants.split(',')[0]} {diff:.3g}",
              flush=True)
        for _ in range(2):
            run(fn)
        # Each variant keeps its own compiled graph; the patched classes are only read while tracing.

    times = {v: [] for v in compiled}
    for _ in range(args.rounds):
        for variant, fn in compiled.items():
            apply(variant)
            sync()
            start = time.perf_counter()
            for _ in range(args.iters):
                run(fn)
            sync()
            times[variant].append((time.perf_counter() - start) * 1e3 / args.iters)
    base = statistics.median(next(iter(times.values())))
    print(f"one {args.kind} layer, forward + backward, median of {args.rounds} rounds of {args.iters}:")
    for variant, ts in times.items():
        m = statistics.median(ts)
        print(f"  {variant:>36}: {m:7.3f} ms  ({m - base:+.3f} ms; x5 layers {5 * (m - base):+.2f} ms a step)  rounds {' '.join(f'{t:.3f}' for t in ts)}")

    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        for variant, fn in compiled.items():
            apply(variant)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    run(fn)
                torch.cuda.synchronize()
            print(f"--- {variant}: kernels, 3 calls")
            print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=22, max_name_column_width=100))


if __name__ == "__main__":
    main()
