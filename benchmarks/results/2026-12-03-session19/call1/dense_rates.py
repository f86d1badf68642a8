"""Attention kernels' own rates at the drafter's pair count, without its mask: 8,192 queries x 32 heads
(8 key heads) each seeing the same 1,664 keys (about the 27B step's mean visible keys a query), forward
and backward, as flex-attention (no BlockMask, query heads packed per key head as the drafter runs it)
and as SDPA's flash kernel (FlashAttention-2, GQA). Useful FLOPs 4*32*128*8192*1664 forward, twice that
backward."""
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import flex_attention

from benchmarks.flex_configs import time_config
from dflash_cache.drafter.attention import KERNEL_OPTIONS

g = torch.Generator("cuda").manual_seed(0)
q = torch.randn(1, 32, 8192, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
k, v = (torch.randn(1, 8, 1664, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_() for _ in range(2))
flops = 4 * 32 * 128 * 8192 * 1664
fwd, bwd, _ = time_config(q, k, v, None, KERNEL_OPTIONS, None, 10, 4)
print(f"flex, no mask, packed 4: fwd {fwd:.3f} ms ({flops / fwd / 1e9:.0f} TFLOP/s)  bwd {bwd:.3f} ms ({2 * flops / bwd / 1e9:.0f} TFLOP/s)")


def sdpa_times(iters: int = 10) -> tuple[float, float]:
    grad = torch.randn_like(q)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        run = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
        for _ in range(3):
            run().backward(grad)
        f, b = [], []
        for _ in range(iters):
            e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            e[0].record(); out = run(); e[1].record(); out.backward(grad); e[2].record()
            torch.cuda.synchronize()
            f.append(e[0].elapsed_time(e[1])); b.append(e[1].elapsed_time(e[2]))
    return sum(f) / iters, sum(b) / iters


fwd, bwd = sdpa_times()
print(f"SDPA flash (FA2), GQA:   fwd {fwd:.3f} ms ({flops / fwd / 1e9:.0f} TFLOP/s)  bwd {bwd:.3f} ms ({2 * flops / bwd / 1e9:.0f} TFLOP/s)")
