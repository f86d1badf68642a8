"""The drafter step's matmuls as they run inside it, each set beside the same matmul alone.

    PYTHONPATH=. python benchmarks/step_gemms.py [--preset qwen3.6-27b] [--tokens 16384] [--anchors 512]
                 [--mode compiled] [--iters 20] [--head-chunks 256,512,1024,2048] [--rounds 5]

benchmarks/gemms.py times each matmul of the step alone with row-major operands. This one profiles
benchmarks/drafter.py's step itself (PROFILED_STEPS steps after 5 of warm-up, shapes recorded) and groups the GPU time
of every cuBLAS call by its operands' sizes and strides, which decide the kernel cuBLAS picks. For each
group: milliseconds a step inside the step, the same call alone with operands of the same strides, and
alone with the operands swapped ((B^T A^T)^T, the other layout of one product), with TFLOP/s against
the 790 that MFU uses. The totals say what the step's matmuls lose to running inside it, what the
better layout of each would save, and what they would take with each group at its fastest.

--head-chunks: the LM head's loss and input gradient for one step's rows (head_loss.head_cross_entropy:
forward matmul, row passes, input-gradient matmul) at each chunk size, the sizes interleaved over
--rounds rounds; the median of each, in milliseconds a step.
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.drafter import add_step_shape_arguments, drafter_step
from benchmarks.profiling import cuda_mean_ms, kernel_launches
from dflash_cache.drafter.config_file import load_drafter_config
from dflash_cache.drafter.head_loss import head_cross_entropy

MATMULS = ("aten::mm", "aten::addmm")
PROFILED_STEPS = 3


def step_matmuls(trace: Path) -> dict[tuple, list[float]]:
    """(op, dims, strides) -> GPU milliseconds of each of its calls, from a trace with shapes."""
    events = json.loads(trace.read_text())["traceEvents"]
    ops = defaultdict(list)  # thread -> [(start, end, key)]
    for e in events:
        if e.get("cat") == "cpu_op" and e["name"] in MATMULS:
            args = e["args"]
            key = (e["name"], json.dumps(args["Input Dims"]), json.dumps(args["Input Strides"]))
            ops[e["tid"]].append((e["ts"], e["ts"] + e["dur"], key))
    for spans in ops.values():
        spans.sort()
    launches = kernel_launches(events)
    calls = defaultdict(lambda: defaultdict(float))  # key -> enclosing op's start -> GPU ms
    for e in events:
        if e.get("cat") != "kernel" or e["args"].get("correlation") not in launches:
            continue
        tid, at = launches[e["args"]["correlation"]]
        spans = ops.get(tid, [])
        i = bisect.bisect_right(spans, (at, float("inf"), ())) - 1
        if i >= 0 and spans[i][0] <= at <= spans[i][1]:
            calls[spans[i][2]][spans[i][0]] += e["dur"] / 1e3
    return {key: list(by_call.values()) for key, by_call in calls.items()}


def operands(
    op: str, dims: list, strides: list
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(addmm's added input or None, mat1, mat2, the out= tensor or None) with the recorded sizes and strides:
    mm(mat1, mat2[, out]) and addmm(input, mat1, mat2, beta, alpha[, out])."""

    def tensor(i: int) -> torch.Tensor:
        return torch.empty_strided(dims[i], strides[i], device="cuda", dtype=torch.bfloat16).normal_()

    first = 1 if op == "aten::addmm" else 0
    out = next((i for i in range(first + 2, len(dims)) if len(dims[i]) == 2), None)
    return (tensor(0) if first else None, tensor(first), tensor(first + 1), None if out is None else tensor(out))


def product_flops(op: str, dims: list) -> float:
    first = 1 if op == "aten::addmm" else 0
    (m, k), (_, n) = dims[first], dims[first + 1]
    return 2.0 * m * k * n


def alone_ms(op: str, dims: list, strides: list, iters: int, swapped: bool) -> float:
    added, a, b, out = operands(op, dims, strides)
    if swapped:  # the same product with the operands' roles exchanged, into the same output memory
        if added is not None:
            return cuda_mean_ms(
                lambda: torch.addmm(added.t(), b.t(), a.t(), out=None if out is None else out.t()), iters
            )
        return cuda_mean_ms(lambda: torch.mm(b.t(), a.t(), out=None if out is None else out.t()), iters)
    if added is not None:
        return cuda_mean_ms(lambda: torch.addmm(added, a, b, out=out), iters)
    return cuda_mean_ms(lambda: torch.mm(a, b, out=out), iters)


def profile_step(args, config) -> dict[tuple, list[float]]:
    from torch.profiler import ProfilerActivity, profile

    step, *_ = drafter_step(config, "cuda", args.mode, args.tokens, args.anchors)
    for k in range(5):
        step(k)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for k in range(PROFILED_STEPS):
            step(k)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(trace))
        return step_matmuls(trace)


def report_matmuls(found: dict[tuple, list[float]], iters: int, peak: float) -> None:
    print(f"{'op':<12} {'dims':<34} {'strides':<30} {'calls':>5} {'in step':>16} {'alone':>16} {'swapped':>16}")
    totals = [0.0, 0.0, 0.0, 0.0]
    for (op, dims, strides), times in sorted(found.items(), key=lambda kv: -sum(kv[1])):
        d, s = json.loads(dims), json.loads(strides)
        flops = product_flops(op, d)
        inside = statistics.mean(times)
        alone = alone_ms(op, d, s, iters, swapped=False)
        swapped = alone_ms(op, d, s, iters, swapped=True)
        per_step = len(times) / PROFILED_STEPS
        for i, ms in enumerate((inside, alone, min(alone, swapped), min(inside, alone, swapped))):
            totals[i] += ms * per_step
        cells = [f"{ms:7.3f} ms {flops / ms / 1e9:4.0f}" for ms in (inside, alone, swapped)]
        print(f"{op:<12} {dims:<34} {strides:<30} {per_step:5.1f} " + " ".join(cells), flush=True)
    print(
        f"a step: in the step {totals[0]:.1f} ms, alone {totals[1]:.1f} ms, alone in the faster layout "
        f"{totals[2]:.1f} ms, each group at the fastest of the three {totals[3]:.1f} ms (ms per call and TFLOP/s "
        f"above; MFU's peak {peak:.0f})"
    )


def head_chunks(config, rows: int, sizes: list[int], rounds: int) -> None:
    g = torch.Generator("cuda").manual_seed(0)
    weight = torch.randn(config.vocab_size, config.hidden_size, device="cuda", generator=g).mul_(0.02).bfloat16()
    states = torch.randn(rows, config.hidden_size, device="cuda", generator=g).bfloat16().requires_grad_()
    labels = torch.randint(config.vocab_size, (rows,), device="cuda", generator=g)
    row_weights = torch.rand(rows, device="cuda", generator=g)
    times = defaultdict(list)
    for _ in range(rounds):
        for size in sizes:
            times[size].append(
                cuda_mean_ms(lambda: head_cross_entropy(states, weight, labels, row_weights, size), 5, 2)
            )
    for size in sizes:
        print(
            f"LM head, {rows} rows in chunks of {size}: {statistics.median(times[size]):.2f} ms a step "
            f"(median of {rounds}; rounds {', '.join(f'{t:.2f}' for t in times[size])})",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_shape_arguments(parser)
    parser.add_argument(
        "--mode",
        default="compiled",
        help="the step's mode: compiled or eager (drafter.py's); '' for --head-chunks alone",
    )
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--peak-tflops", type=float, default=790.0)
    parser.add_argument("--head-chunks", default="", help="comma-separated chunk sizes to time the LM head at")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    config = load_drafter_config(args.preset)
    if args.mode:
        report_matmuls(profile_step(args, config), args.iters, args.peak_tflops)
    if args.head_chunks:
        rows = args.anchors * (config.block_size - 1)
        head_chunks(config, rows, [int(s) for s in args.head_chunks.split(",")], args.rounds)


if __name__ == "__main__":
    main()
