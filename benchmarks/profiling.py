"""Profiling for the benchmarks: what one piece of work spends its GPU time on, and how long it takes."""

from __future__ import annotations

import time
from pathlib import Path

import torch


def profile_run(folder: Path, name: str, run) -> None:
    """A Chrome trace and a table sorted by GPU time, and the share of the wall time the GPU was busy."""
    from torch.profiler import ProfilerActivity, profile

    folder.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    wall = time.perf_counter() - start
    prof.export_chrome_trace(str(folder / f"{name}_trace.json"))
    averages = prof.key_averages()
    table = averages.table(sort_by="self_device_time_total", row_limit=60, max_name_column_width=110)
    gpu = sum(e.self_device_time_total for e in averages) / 1e6
    summary = f"{name}: wall {wall:.2f} s under the profiler, kernels {gpu:.2f} s ({gpu / wall:.2f} of wall)"
    (folder / f"{name}_profile.txt").write_text(summary + "\n" + table)
    print(summary)
    print(table)


def cuda_mean_ms(fn, iters: int, warmup: int = 3) -> float:
    """Mean GPU milliseconds of `fn()` over `iters` back-to-back calls, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters
