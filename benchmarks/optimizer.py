"""The drafter's optimizer step alone: train's CompiledAdamW (train/optim.py), with bf16 working matrices as
train runs it and on fp32 weights, against torch's fused AdamW and torch's foreach AdamW compiled, and the
memory floor of the same bytes.

    PYTHONPATH=. python benchmarks/optimizer.py [--preset qwen3.6-27b] [--iters 10]

The preset's drafter parameters (fp32, on the GPU) with random gradients; each variant's mean step in
milliseconds (CompiledAdamW's with train's clipping, `train/optim.py` clipped_step, which it does as it
reads the gradients; torch's without) and the rate at which it moves AdamW's bytes (parameter, gradient and both moments read,
parameter and moments written: 28 bytes a parameter). The floor is a device-to-device copy of a 2 GiB
buffer, timed the same way, at the rate it reaches. With bf16 working matrices the bytes are the same
(fp32 master and moments read and written, a bf16 gradient read and a bf16 copy written).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.profiling import cuda_mean_ms
from dflash_cache.drafter.config_file import load_drafter_config
from dflash_cache.drafter.model import DFlashDrafter
from dflash_cache.train.optim import CompiledAdamW, clipped_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3.6-27b")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()

    def drafter_parameters() -> list[torch.nn.Parameter]:
        with torch.device("cuda"):
            return list(DFlashDrafter(load_drafter_config(args.preset)).parameters())

    params, working = drafter_parameters(), drafter_parameters()
    count = sum(p.numel() for p in params)
    norm = torch.tensor(0.5, device="cuda")
    variants = {
        "fused AdamW (torch)": torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True),
        "foreach AdamW, compiled": torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, foreach=True),
        "CompiledAdamW, fp32": CompiledAdamW(params, lr=1e-4, weight_decay=0.01),
        "CompiledAdamW, bf16 matrices (train's)": CompiledAdamW(
            working, lr=1e-4, weight_decay=0.01, bf16_matrices=True
        ),
    }
    for p in params + working:  # after bf16_matrices made the working matrices bf16
        p.grad = torch.randn_like(p) * 1e-3
    for name, optimizer in variants.items():
        step = optimizer.step
        if isinstance(optimizer, CompiledAdamW):
            step = lambda o=optimizer: clipped_step(o, norm, 1.0)  # noqa: E731
        elif optimizer.defaults["foreach"]:
            step = torch.compile(step)
        ms = cuda_mean_ms(step, args.iters)
        print(
            f"{name:>38}: {ms:7.2f} ms  {28 * count / ms / 1e9:5.2f} TB/s  ({count / 1e9:.2f} B parameters)", flush=True
        )
    source = torch.empty(1 << 30, dtype=torch.float16, device="cuda")
    target = torch.empty_like(source)
    ms = cuda_mean_ms(lambda: target.copy_(source), args.iters)
    rate = 2 * source.nbytes / ms / 1e9
    print(f"{'copy (floor)':>38}: {rate:5.2f} TB/s -> AdamW's bytes in {28 * count / rate / 1e9:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
