"""The head loss's row passes for one step's 7,680 rows (chunks of 1024 x 248,320 bf16 logits): session 18's
statistics kernel (one program a row) against the landed one (8 segments a row, then a combine), statistics
alone and with the gradient pass, interleaved over 5 rounds; outputs compared."""
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from session18_head_kernel import row_terms as old_terms  # noqa: E402

from benchmarks.profiling import cuda_mean_ms  # noqa: E402
from dflash_cache.drafter.head_kernel import row_terms as new_terms  # noqa: E402

g = torch.Generator("cuda").manual_seed(0)
chunks = [torch.randn(1024, 248320, device="cuda", generator=g).mul_(3).bfloat16() for _ in range(7)]
chunks.append(torch.randn(512, 248320, device="cuda", generator=g).mul_(3).bfloat16())
labels = [torch.randint(248320, (c.shape[0],), device="cuda", generator=g) for c in chunks]
scales = [torch.rand(c.shape[0], device="cuda", generator=g) for c in chunks]
worst = 0.0
for c, l, s in zip(chunks, labels, scales):
    a, b = old_terms(c, l, s, True), new_terms(c, l, s, True)
    assert torch.equal(a[1], b[1]), "argmax differs"
    torch.testing.assert_close(a[0], b[0], atol=1e-4, rtol=1e-5)
    worst = max(worst, (a[2].float() - b[2].float()).abs().max().item())
print(f"outputs: argmax equal, nll within 1e-4, gradients differ by at most {worst:.2e}")
gb = sum(c.numel() * 2 for c in chunks) / 1e9
for with_grad in (False, True):
    times = {"session 18": [], "segments": []}
    for _ in range(5):
        for name, terms in (("session 18", old_terms), ("segments", new_terms)):
            times[name].append(cuda_mean_ms(lambda: [terms(c, l, s, with_grad) for c, l, s in zip(chunks, labels, scales)], 10))
    for name, t in times.items():
        m = statistics.median(t)
        print(f"{'stats + gradient' if with_grad else 'stats alone':<17} {name:<11} {m:6.3f} ms a step"
              + ("" if with_grad else f" ({gb / m:.2f} TB/s)") + f"  rounds {', '.join(f'{x:.3f}' for x in t)}")
