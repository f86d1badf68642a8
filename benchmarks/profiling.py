"""Profiling for the benchmarks: what one piece of work spends its GPU time on, and how long it takes."""

from __future__ import annotations

import time
from pathlib import Path

import torch


def profile_run(folder: Path, name: str, run) -> None:
    """A Chrome trace and a table sorted by GPU time (every row in the file, the first 60 printed), and the
    share of the wall time the GPU was busy."""
    from torch.profiler import ProfilerActivity, profile

    folder.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    wall = time.perf_counter() - start
    trace = folder / f"{name}_trace.json"
    prof.export_chrome_trace(str(trace))
    averages = prof.key_averages()
    table = lambda rows: averages.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=110)  # noqa: E731
    gpu = sum(e.self_device_time_total for e in averages) / 1e6
    summary = f"{name}: wall {wall:.2f} s under the profiler, kernels {gpu:.2f} s ({gpu / wall:.2f} of wall)"
    idle = gpu_idle(trace)
    kinds = kernel_kinds(trace)
    (folder / f"{name}_profile.txt").write_text(summary + "\n" + idle + "\n" + kinds + "\n" + table(-1))
    print(summary)
    print(idle)
    print(kinds)
    print(table(60))


def kernel_launches(events: list[dict]) -> dict[int, tuple[int, float]]:
    """A Chrome trace's kernel launches: correlation id -> (host thread, time). cuBLAS launches its kernels
    through the driver API, most others through the runtime."""
    return {
        e["args"]["correlation"]: (e["tid"], e["ts"])
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }


def gpu_idle(trace: Path, shown: int = 12, least_us: float = 20.0) -> str:
    """From a Chrome trace: the time between the first and last kernel when no kernel, copy or memset
    ran, and its longest gaps, each with the host ops that were running when the kernel that ended it
    was launched (outermost first)."""
    import json

    events = json.loads(trace.read_text())["traceEvents"]
    device = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"]
    )
    if not device:
        return "no kernels in the trace"
    launches = {correlation: ts for correlation, (_, ts) in kernel_launches(events).items()}
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "python_function")]
    gaps, end = [], device[0]["ts"] + device[0]["dur"]
    for e in device[1:]:
        if e["ts"] - end > least_us:
            gaps.append((e["ts"] - end, e))
        end = max(end, e["ts"] + e["dur"])
    span = end - device[0]["ts"]
    idle = sum(g for g, _ in gaps)
    lines = [
        f"GPU idle {idle / 1e3:.2f} ms of {span / 1e3:.2f} ms between the first and last kernel, "
        f"in {len(gaps)} gaps over {least_us:.0f} us; the longest:"
    ]
    for gap, kernel in sorted(gaps, key=lambda g: -g[0])[:shown]:
        at = launches.get(kernel["args"].get("correlation"), kernel["ts"])
        around = sorted((e for e in host if e["ts"] <= at <= e["ts"] + e.get("dur", 0)), key=lambda e: -e.get("dur", 0))
        names = " > ".join(e["name"][:60] for e in around[:4])
        lines.append(f"  {gap / 1e3:7.2f} ms before {kernel['name'][:60]}  (launched in: {names})")
    return "\n".join(lines)


KERNEL_KINDS = {  # kernel name fragments, first match wins
    "matmul (cuBLAS)": ("nvjet", "gemm", "cutlass", "xmma"),
    "flex-attention backward": ("flex_attention_backward",),
    "flex-attention forward": ("flex_attention", "triton_tem"),  # the step's only Triton templates are flex's
}


def kernel_kinds(trace: Path, shown: int = 30) -> str:
    """From a Chrome trace: GPU time by kind of kernel (cuBLAS matmuls, flex-attention, everything inside
    an `Optimizer.step` range on the GPU's timeline, the rest) and the rest's largest kernels by name."""
    import json
    from collections import Counter

    events = json.loads(trace.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    steps = [
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") == "gpu_user_annotation" and e["name"].startswith("Optimizer.step")
    ]
    kinds, rest, counts = Counter(), Counter(), Counter()
    for e in kernels:
        name = e["name"]
        kind = next((k for k, parts in KERNEL_KINDS.items() if any(p in name for p in parts)), None)
        if kind is None and any(a <= e["ts"] < b for a, b in steps):
            kind = "optimizer step"
        if kind is None:
            kind = "rest"
            rest[name] += e["dur"]
            counts[name] += 1
        kinds[kind] += e["dur"]
    total = sum(kinds.values())
    lines = [f"GPU time by kind ({total / 1e3:.2f} ms in all):"]
    lines += [f"  {kind:<26} {us / 1e3:9.2f} ms  {us / total:6.1%}" for kind, us in kinds.most_common()]
    lines.append(f"the rest's largest {shown} kernels (ms in all, calls):")
    lines += [f"  {us / 1e3:8.2f} ms {counts[name]:5d}  {name[:120]}" for name, us in rest.most_common(shown)]
    return "\n".join(lines)


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
