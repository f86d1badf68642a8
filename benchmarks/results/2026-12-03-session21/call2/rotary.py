"""Each head's RMSNorm, rotary and flex-attention's layout, forward and backward, at the 27B drafter's shapes:
Inductor's code for model.py's torch chain (as the compiled drafter ran it up to session 20) against the Triton
pass (drafter/rotary_kernel.py) at several tile sizes and warp counts.

    PYTHONPATH=. python benchmarks/results/2026-12-03-session21/call2/rotary.py [--rounds 5]

Queries: 8192 tokens (512 blocks of 16) x 32 heads; keys: 24,592 tokens (16,400 context + 8192 block) x 8
heads; head size 128, bf16, positions of the peer's first batch's shape (up to 4000). Each variant is one
forward and one backward for both, timed with CUDA events over 20 calls, medians of interleaved rounds.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from dflash_cache.drafter import rotary_kernel
from dflash_cache.drafter.model import RMSNorm, attention_heads, rotary_frequencies


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--configs", default="32:4:8,16:4:4,64:8:8,32:4:4,32:8:8")
    args = parser.parse_args()
    g = torch.Generator("cuda").manual_seed(0)
    d = 128
    inv_freq = rotary_frequencies(d, 1e7).cuda()
    norms = [RMSNorm(d, 1e-6).cuda() for _ in range(2)]
    shapes = [(8192, 32), (24592, 8)]
    xs = [torch.randn(t, h * d, device="cuda", generator=g).bfloat16().requires_grad_() for t, h in shapes]
    pos = [torch.randint(0, 4000, (t,), device="cuda", generator=g) for t, _ in shapes]
    grads = [torch.randn(1, 8, t * h // 8, d, device="cuda", generator=g).bfloat16() for t, h in shapes]

    def chain(fused):
        def run():
            for x, p, gr, norm in zip(xs, pos, grads, norms):
                attention_heads(x, norm, p, inv_freq, 8, fused).backward(gr)
        return run

    inductor = torch.compile(lambda x, n, p, gr: attention_heads(x, n, p, inv_freq, 8, False).backward(gr), dynamic=False)

    def inductor_run():
        for x, p, gr, norm in zip(xs, pos, grads, norms):
            inductor(x, norm, p, gr)

    variants = {"inductor (torch chain)": inductor_run}
    for c in args.configs.split(","):
        block, fw, bw = map(int, c.split(":"))

        def kernel_run(block=block, fw=fw, bw=bw):
            rotary_kernel.BLOCK_T, rotary_kernel.FORWARD_WARPS, rotary_kernel.BACKWARD_WARPS = block, fw, bw
            chain(True)()
        variants[f"triton BLOCK_T={block} warps {fw}/{bw}"] = kernel_run
    outs = {}
    for name, run in variants.items():
        for x in xs:
            x.grad = None
        run()
        outs[name] = [x.grad.clone() for x in xs]
    ref = outs["inductor (torch chain)"]
    for name, got in outs.items():
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, ref))
        print(f"{name}: input-gradient max |difference| from inductor's {diff:.3g}", flush=True)
    times = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, run in variants.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                run()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / 20)
    for name, ts in times.items():
        print(f"{name:>34}: {statistics.median(ts):.3f} ms a layer, q and k forward + backward (x5 layers: "
              f"{5 * statistics.median(ts):.2f} ms); rounds " + " ".join(f"{t:.3f}" for t in ts), flush=True)


if __name__ == "__main__":
    main()
