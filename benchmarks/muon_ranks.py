"""Muon's step on several ranks: each rank orthogonalising every matrix, against each its share (train/muon.py).

    PYTHONPATH=. python benchmarks/muon_ranks.py [--preset qwen3.6-27b|FILE.json] [--ranks 2] [--steps 3] [--device cpu]

The preset drafter's matrices (fp32, random gradients, the same on every rank, as DDP leaves them) in
--ranks processes at once, gloo on the CPU or NCCL with a GPU a rank. Each process times its Muon step
first with no process group (every rank computes every iteration, as torch.optim.Muon does under DDP),
then in a process group (each rank its share, then the broadcasts); the weights after the two runs must be
equal. Prints the mean step of each and their ratio; rank 0's figures.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from dflash_cache.drafter.config_file import load_drafter_config
from dflash_cache.drafter.model import DFlashDrafter
from dflash_cache.target.precision import forward_dtype
from dflash_cache.train.distributed import init_rank, launch, shutdown
from dflash_cache.train.muon import Muon


def timed_steps(device: torch.device, preset: str, steps: int) -> tuple[float, list[torch.Tensor]]:
    torch.manual_seed(0)
    with torch.device(device):
        model = DFlashDrafter(load_drafter_config(preset))
    matrices = [p for p in model.parameters() if p.dim() == 2 and p.requires_grad]
    optimizer = Muon(matrices, lr=1e-3, weight_decay=0.1, momentum=0.95, ns_dtype=forward_dtype(device))
    seconds = []
    for step in range(steps + 1):  # the first is a warm-up
        g = torch.Generator(device).manual_seed(step)
        for p in matrices:
            p.grad = torch.randn(p.shape, generator=g, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    return sum(seconds[1:]) / steps, [p.detach() for p in matrices]


def rank_main(rank: int, world: int, device: str, args: argparse.Namespace) -> None:
    me = init_rank(rank, world, device, timeout_s=600)
    if me.device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        dist.barrier()
    # every rank alone at once: the group exists for the barriers, so the step is told it is alone
    initialized = dist.is_initialized
    dist.is_initialized = lambda: False
    alone_s, alone = timed_steps(me.device, args.preset, args.steps)
    dist.is_initialized = initialized
    if world > 1:
        dist.barrier()
    shared_s, shared = timed_steps(me.device, args.preset, args.steps)
    equal = all(torch.equal(a, b) for a, b in zip(alone, shared))
    if me.is_main:
        print(
            f"{world} ranks, {args.preset}, {me.device.type}: every rank every matrix {1e3 * alone_s:.1f} ms a step, "
            f"each its share {1e3 * shared_s:.1f} ms ({alone_s / shared_s:.2f}x); weights equal: {equal}",
            flush=True,
        )
    shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3.6-27b")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    devices = [f"cuda:{i}" for i in range(args.ranks)] if args.device == "cuda" else ["cpu"] * args.ranks
    launch(rank_main, devices, (args,))


if __name__ == "__main__":
    main()
