"""drafter/rotary_kernel.py's pass against model.py's torch chain in Triton's interpreter, on a CPU (no GPU):
the kernels' arithmetic and indexing, not their speed. The interpreter has no libdevice, so tl.cos and tl.sin
stand in for it here.

    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/results/2026-12-03-session21/interpreter_check.py

Prints, per case, the largest difference of the output, the input's gradient and the weight's gradient,
relative to the reference's largest magnitude.
"""

import types

import torch
import triton
import triton.language as tl

from dflash_cache.drafter import rotary_kernel
from dflash_cache.drafter.model import RMSNorm, attention_heads, rotary_frequencies



@triton.jit
def _cos(x):
    return tl.cos(x)


@triton.jit
def _sin(x):
    return tl.sin(x)


rotary_kernel.libdevice = types.SimpleNamespace(cos=_cos, sin=_sin)
torch.manual_seed(0)
for heads, key_heads, dim, dtype in [(4, 2, 32, torch.float32), (8, 8, 16, torch.float32), (32, 8, 128, torch.bfloat16)]:
    norm = RMSNorm(dim, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(dim))
    inv_freq = rotary_frequencies(dim, 1e6)
    for tokens in (1, 45, 70):
        x = (torch.randn(tokens, heads * dim) * 3).to(dtype)
        positions = torch.randint(0, 40000, (tokens,))
        grad = torch.randn(1, key_heads, tokens * heads // key_heads, dim).to(dtype)
        results = []
        for fused in (False, True):
            xi = x.clone().requires_grad_()
            norm.weight.grad = None
            if fused:
                out = rotary_kernel.norm_rotate_pack(xi, norm.weight, positions, inv_freq, key_heads, 1e-6)[0]
            else:
                out = attention_heads(xi, norm, positions, inv_freq, key_heads, False)
            out.backward(grad)
            results.append((out.detach().float(), xi.grad.float(), norm.weight.grad.clone()))
        print(f"heads {heads}/{key_heads}, head size {dim}, {str(dtype)[6:]}, {tokens} tokens: out / dx / dweight "
              + " / ".join(f"{(a - b).abs().max().item() / b.abs().max().item():.1e}" for a, b in zip(*results[::-1])))
