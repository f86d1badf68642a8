"""One forward of a target on a packed row, through HF's `sdpa` attention and through the packed rows'
attention (`target/varlen.py`, one sample spanning the row), in each of --dtypes, each timed twice in
this process; and whether this CPU computes bf16 products fast (target/precision.py), which decides the
dtype `extract` runs the target in on a CPU.

    OMP_NUM_THREADS=2 python -m benchmarks.cpu_forward --target MODEL_DIR [--tokens 4404] [--dtypes bfloat16,float32]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM

from dflash_cache.target.precision import cpu_bf16_is_fast, forward_dtype, product_seconds
from dflash_cache.target.varlen import ATTENTION


def timed_forwards(target: str, tokens: int, runs: int, dtype: torch.dtype) -> dict[str, list[float]]:
    ids = torch.randint(0, 1000, (1, tokens), generator=torch.Generator().manual_seed(0))
    bounds = torch.tensor([0, tokens], dtype=torch.int32)
    packed = dict(
        cu_seq_lens_q=bounds,
        cu_seq_lens_k=bounds,
        max_length_q=tokens,
        max_length_k=tokens,
        cu_seq_lens_cpu=bounds,
        position_ids=torch.arange(tokens)[None],
    )
    seconds: dict[str, list[float]] = {}
    for attention, kwargs in (("sdpa", {}), (ATTENTION, packed)):
        model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, attn_implementation=attention)
        with torch.inference_mode():
            for _ in range(runs):
                start = time.perf_counter()
                model.eval().model(ids, **kwargs)
                seconds.setdefault(attention, []).append(time.perf_counter() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--tokens", type=int, default=4404)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--dtypes", default="bfloat16")
    args = parser.parse_args()
    probe = {name: product_seconds(getattr(torch, name)) * 1e3 for name in ("bfloat16", "float32")}
    print(
        f"target/precision.py's probe: bf16 {probe['bfloat16']:.2f} ms, fp32 {probe['float32']:.2f} ms; "
        f"bf16 products fast on this CPU: {cpu_bf16_is_fast()} (extract runs the target in {forward_dtype('cpu')})"
    )
    for name in args.dtypes.split(","):
        for attention, times in timed_forwards(args.target, args.tokens, args.runs, getattr(torch, name)).items():
            print(f"{name} {attention}: {', '.join(f'{t:.1f}' for t in times)} s")


if __name__ == "__main__":
    main()
