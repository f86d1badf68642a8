"""Matmul rate after idle against sustained, with the card's clocks and power sampled alongside.

    PYTHONPATH=. python benchmarks/results/2026-12-03-session21/call1/sustained_gemm.py [--seconds 6]

For each shape: 3 s idle, then back-to-back matmuls for --seconds, timed in windows of 10 with CUDA
events (the operands rotate among 4 sets so that L2 holds none of them). nvidia-smi samples the SM
clock, power draw and throttle reasons every 100 ms in the background (its CSV beside the log).
"""

from __future__ import annotations

import argparse
import subprocess
import time

import torch


def windows(m: int, k: int, n: int, seconds: float) -> list[float]:
    sets = [(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), torch.randn(k, n, device="cuda", dtype=torch.bfloat16))
            for _ in range(4)]
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    torch.mm(*sets[0], out=out)
    torch.cuda.synchronize()
    time.sleep(3.0)
    rates, start, i = [], time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(10):
            torch.mm(*sets[i % 4], out=out)
            i += 1
        e1.record()
        e1.synchronize()
        rates.append(10 * 2 * m * k * n / (e0.elapsed_time(e1) * 1e-3) / 1e12)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--csv", default="clocks.csv")
    args = parser.parse_args()
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,"
                            "clocks_event_reasons.active", "--format=csv", "-lms", "100"],
                           stdout=open(args.csv, "w"), stderr=subprocess.STDOUT)
    try:
        for m, k, n in [(8192, 8192, 8192), (8192, 5120, 17408), (1024, 5120, 248320)]:
            t0 = time.time()
            rates = windows(m, k, n, args.seconds)
            first, tail = rates[:3], rates[len(rates) // 2:]
            print(f"{m} x {k} x {n}: started {t0:.1f}; first windows " + " ".join(f"{r:.0f}" for r in first)
                  + f" TFLOP/s; second half median {sorted(tail)[len(tail) // 2]:.0f} (min {min(tail):.0f}, "
                  f"max {max(tail):.0f}) over {len(rates)} windows of 10", flush=True)
    finally:
        smi.terminate()


if __name__ == "__main__":
    main()
