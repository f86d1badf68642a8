"""Session 17 call 2: the LM-head loss's two matmuls at the 27B shapes, per chunk of rows and layout, each
timed alone (bf16, mean of 30 after 5): logits = states @ W^T (forward) and states' gradient = G @ W.

    PYTHONPATH=. python benchmarks/results/2026-12-02-session17/call2/head_gemms.py
"""

import torch

from benchmarks.profiling import cuda_mean_ms

HIDDEN, VOCAB, ROWS = 5120, 248320, 7680  # 512 blocks x 15 predicted rows


def main():
    g = torch.Generator("cuda").manual_seed(0)
    weight = torch.randn(VOCAB, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    states = torch.randn(2048, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
    grads = torch.randn(2048, VOCAB, device="cuda", dtype=torch.bfloat16, generator=g) * 1e-4
    for rows in (256, 512, 768, 1024, 1536, 2048):
        s, gr = states[:rows], grads[:rows]
        flops = 2 * rows * HIDDEN * VOCAB
        cases = {
            "forward s @ W^T": lambda: s @ weight.T,
            "forward (W @ s^T)^T": lambda: (weight @ s.T).T,
            "input grad G @ W": lambda: gr @ weight,
            "input grad G @ W in 512-row pieces": lambda: torch.cat([p @ weight for p in gr.split(512)]),
        }
        for name, fn in cases.items():
            ms = cuda_mean_ms(fn, iters=30, warmup=5)
            print(f"rows {rows:>5} {name:<36} {ms:7.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s  "
                  f"a step's {ROWS} rows: {ms * ROWS / rows:6.2f} ms", flush=True)


if __name__ == "__main__":
    main()
