"""The warm-up of a hybrid target's extraction alone: compiling and autotuning its kernels, cold
and then with the kernel cache it filled, each in a new process, as `extract` starts it.

    PYTHONPATH=. python benchmarks/warmup.py [--layers-cut 16] [--row-tokens 49152] [--work DIR] [--runs cold,warm]

Only the target's config is written (the warm-up builds a random model of one layer of each kind
of the target's shape); `start_background_warmup` then runs in a new process, first with an empty
kernel cache folder, then again with that folder. Its own line ("kernels compiled and autotuned
ahead ...") says where its seconds went; the wall time here adds the process start and imports.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

from benchmarks.targets import target_config
from dflash_cache.extract.packing import PackedLayout
from dflash_cache.extract.warmup import start_background_warmup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers-cut", type=int, default=16)
    parser.add_argument("--row-tokens", type=int, default=49152, help="extract's default --token-budget")
    parser.add_argument("--work", type=Path, default=Path("/tmp/warmup-bench"))
    parser.add_argument("--runs", default="cold,warm", help="cold (an empty kernel cache), then warm (the cache it filled)")
    args = parser.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    target, kernels = args.work / "target", args.work / "kernels"
    config = target_config("qwen3.6-27b-cut", args.layers_cut)
    config.save_pretrained(target)
    for run in args.runs.split(","):
        started = time.perf_counter()
        process = start_background_warmup(target, PackedLayout(args.row_tokens), "cuda", kernels, config)
        if process is None:
            raise SystemExit("this benchmark needs a CUDA GPU")
        process.join()
        print(f"{run}: exit code {process.exitcode}, {time.perf_counter() - started:.1f} s from the process start", flush=True)


if __name__ == "__main__":
    main()
