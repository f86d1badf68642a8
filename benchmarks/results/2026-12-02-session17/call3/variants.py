"""Session 17 call 3: side by side in one process, the compiled 27B drafter step (benchmarks/drafter.py's
step: peer batches, 16K tokens, 512 anchors) as the library compiles it (intervals) and with Inductor's
coordinate-descent tuning of its generated kernels (coord).

    PYTHONPATH=. python benchmarks/results/2026-12-02-session17/call3/variants.py [--variants intervals,coord]

Call 3 ran this file's first form, with its own copy of the timing loop (now ../variant_step.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch._inductor.config

sys.path.insert(0, str(Path(__file__).parents[1]))
from variant_step import time_variant  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="intervals,coord")
    args = parser.parse_args()
    for name in args.variants.split(","):
        torch._inductor.config.coordinate_descent_tuning = name == "coord"
        time_variant(name, "compiled")


if __name__ == "__main__":
    main()
