"""Compile and autotune the target's kernels once, before the first real batch, and share them.

Triton (flash-linear-attention's kernels) and Inductor keep what they compile in disk caches:
Triton's default folder, or the one `--kernel-cache` names (it sets TRITON_CACHE_DIR and
TORCHINDUCTOR_CACHE_DIR for this run). A resumed run, a second extraction with the same target and
the other ranks on the node then load kernels instead of compiling and autotuning them again.

The ranks of a node warm up one at a time under a file lock in that folder: the first compiles,
the others find its kernels on disk, so five ranks never compile the same kernel at once.
"""

from __future__ import annotations

import fcntl
import os
import time
from contextlib import contextmanager
from collections.abc import Iterator
from pathlib import Path

import torch

from dflash_cache.extract.batch import Layout
from dflash_cache.extract.runner import TargetRunner


def use_kernel_cache(folder: Path | None) -> Path:
    """Point the compilers' disk caches at `folder` (None: keep TRITON_CACHE_DIR or Triton's
    default); returns the folder in use."""
    if folder is not None:
        folder = Path(folder).expanduser().resolve()
        os.environ["TRITON_CACHE_DIR"] = str(folder / "triton")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "inductor")
        return folder
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


@contextmanager
def node_lock(folder: Path) -> Iterator[None]:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "dflash-cache-warmup.lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def warm_up(runner: TargetRunner, layout: Layout, device: torch.device | str, folder: Path) -> float:
    """Run the layout's warm-up forward, if it has one; returns its seconds."""
    samples = layout.warmup_samples()
    if not samples or torch.device(device).type != "cuda":
        return 0.0  # the CPU compiles nothing
    with node_lock(folder):
        started = time.perf_counter()
        runner.run_batch(layout.build(samples, device))
        torch.cuda.synchronize(device)
        return time.perf_counter() - started
