"""Call 2's comparison (benchmarks/results/2026-12-03-session19/call2/row_stats.py) with the segment
kernel's segments a row and warps a program varied: statistics alone for one step's 7,680 rows, interleaved
over 5 rounds, each against session 18's kernel; outputs compared with it."""
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "call2"))
from session18_head_kernel import row_terms as old_terms  # noqa: E402

import dflash_cache.drafter.head_kernel as kernel  # noqa: E402
from benchmarks.profiling import cuda_mean_ms  # noqa: E402

g = torch.Generator("cuda").manual_seed(0)
chunks = [torch.randn(1024, 248320, device="cuda", generator=g).mul_(3).bfloat16() for _ in range(7)]
chunks.append(torch.randn(512, 248320, device="cuda", generator=g).mul_(3).bfloat16())
labels = [torch.randint(248320, (c.shape[0],), device="cuda", generator=g) for c in chunks]
scales = [torch.rand(c.shape[0], device="cuda", generator=g) for c in chunks]
gb = sum(c.numel() * 2 for c in chunks) / 1e9
variants = [(None, None), (8, 4), (16, 4), (32, 4), (8, 8), (16, 8), (32, 8)]
times = {v: [] for v in variants}


def run(variant, with_grad=False):
    if variant == (None, None):
        return [old_terms(c, l, s, with_grad) for c, l, s in zip(chunks, labels, scales)]
    kernel.SEGMENTS, kernel.WARPS = variant
    return [kernel.row_terms(c, l, s, with_grad) for c, l, s in zip(chunks, labels, scales)]


want = run((None, None))
for v in variants[1:]:
    for a, b in zip(want, run(v)):
        assert torch.equal(a[1], b[1]), f"{v}: argmax differs"
        torch.testing.assert_close(a[0], b[0], atol=1e-4, rtol=1e-5)
for _ in range(5):
    for v in variants:
        times[v].append(cuda_mean_ms(lambda: run(v), 10))
for (segments, warps), t in times.items():
    m = statistics.median(t)
    name = "session 18 (a program a row)" if segments is None else f"{segments} segments, {warps} warps"
    print(f"stats alone  {name:<29} {m:6.3f} ms a step ({gb / m:.2f} TB/s)  rounds {', '.join(f'{x:.3f}' for x in t)}")
