"""The dtype a target's forward runs in: bf16, except on a CPU whose bf16 matrix products are emulated
(AVX2 without AVX512-BF16 or AMX), where a forward in bf16 takes several times as long as in fp32
(BENCHMARKS.md, "Every default, on the CPU"). Measured once per process rather than read from a list of
CPU features. The states a cache stores are bf16 either way."""

from __future__ import annotations

import functools
import time

import torch

PROBE_SIZE = 256  # a product of two 256 x 256 matrices: nothing beside loading a target
SLOW_RATIO = 2.0  # bf16 slower than fp32 by more than this: emulated


def product_seconds(dtype: torch.dtype) -> float:
    """Three products of two PROBE_SIZE x PROBE_SIZE matrices in `dtype`, after one untimed."""
    x = torch.ones(PROBE_SIZE, PROBE_SIZE, dtype=dtype)
    x @ x  # the first call pays for the kernel's setup
    start = time.perf_counter()
    for _ in range(3):
        x @ x
    return time.perf_counter() - start


@functools.cache
def cpu_bf16_is_fast() -> bool:
    return product_seconds(torch.bfloat16) <= SLOW_RATIO * product_seconds(torch.float32)


def forward_dtype(device: str | torch.device) -> torch.dtype:
    if torch.device(device).type == "cpu" and not cpu_bf16_is_fast():
        return torch.float32
    return torch.bfloat16


def generation_dtype(device: str | torch.device) -> torch.dtype | str:
    """What `regenerate --target` loads the model in: its own dtype ("auto"), or fp32 on a CPU slow at
    bf16 products, where a bf16 model would also generate several times slower."""
    return "auto" if forward_dtype(device) == torch.bfloat16 else torch.float32


def describe_forward_dtype(device: str | torch.device) -> str:
    """For the plan line: nothing for bf16, else why the forward runs in fp32."""
    if forward_dtype(device) == torch.bfloat16:
        return ""
    return ", in float32 (this CPU computes bf16 products slowly; the cache stores bf16)"
