"""The dtype a target's forward and a drafter's step run in: bf16, except on a CPU whose bf16 matrix
products are emulated (AVX2 without AVX512-BF16 or AMX), where a forward in bf16 takes several times as
long as in fp32 (BENCHMARKS.md, "Every default, on the CPU"). Measured once per process rather than read
from a list of CPU features. The states a cache stores are bf16 either way."""

from __future__ import annotations

import functools
import time

import torch

PROBE_SIZE = 256  # a product of two 256 x 256 matrices: nothing beside loading a target
PROBE_REPEATS = 5
SLOW_RATIO = 2.0  # bf16 slower than fp32 by more than this: emulated


def product_seconds(dtype: torch.dtype) -> float:
    """The fastest of PROBE_REPEATS products of two PROBE_SIZE x PROBE_SIZE matrices in `dtype` on one
    thread, after one untimed. A busy machine must not change the answer between processes (a resumed
    run computes as the run it resumes): on several threads a product waits for any thread the machine
    has descheduled, which under load made fp32 products look as slow as emulated bf16 ones, and the
    fastest of several discards the other pauses."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.ones(PROBE_SIZE, PROBE_SIZE, dtype=dtype)
        x @ x  # the first call pays for the kernel's setup
        times = []
        for _ in range(PROBE_REPEATS):
            start = time.perf_counter()
            x @ x
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return min(times)


@functools.cache
def cpu_bf16_is_fast() -> bool:
    return product_seconds(torch.bfloat16) <= SLOW_RATIO * product_seconds(torch.float32)


def forward_dtype(device: str | torch.device) -> torch.dtype:
    if torch.device(device).type == "cpu" and not cpu_bf16_is_fast():
        return torch.float32
    return torch.bfloat16


def drafter_autocast(device: torch.device) -> torch.autocast:
    """The drafter's bf16 autocast, off on a CPU slow at bf16 products: the drafter then runs in fp32,
    and so must its frozen target head (`forward_dtype`)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=forward_dtype(device) == torch.bfloat16)


def generation_dtype(device: str | torch.device) -> torch.dtype | str:
    """What `regenerate --target` loads the model in: its own dtype ("auto"), or fp32 on a CPU slow at
    bf16 products, where a bf16 model would also generate several times slower."""
    return "auto" if forward_dtype(device) == torch.bfloat16 else torch.float32


def describe_forward_dtype(device: str | torch.device) -> str:
    """For the plan line: nothing for bf16, else why the forward runs in fp32."""
    if forward_dtype(device) == torch.bfloat16:
        return ""
    return ", in float32 (this CPU computes bf16 products slowly; the cache stores bf16)"
