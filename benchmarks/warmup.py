"""The warm-up of a hybrid target's extraction alone: compiling and autotuning its kernels, cold
and then with the kernel cache it filled, each in a new process, as `extract` starts it.

    PYTHONPATH=. python benchmarks/warmup.py [--layers-cut 16] [--row-tokens 49152] [--work DIR] [--runs cold,warm]

Only the target's config is written (the warm-up builds a random model of one layer of each kind
of the target's shape); `start_background_warmup` then runs in a new process, first with an empty
kernel cache folder, then again with that folder. Its own line ("kernels compiled and autotuned
ahead ...") says where its seconds went; the wall time here adds the process start and imports.

--compile-log FILE then runs the cold warm-up once more, in this process, with a Triton compilation
listener: every compilation (kernel, configuration, seconds, when it ended) goes to FILE as JSON,
and the slowest are printed beside the sum and the span, which tells a pool that is too small from
a few configurations that take most of the time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from benchmarks.targets import target_config
from dflash_cache.extract.packing import PackedLayout
from dflash_cache.target.warmup import start_background_warmup, warm_up_small_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers-cut", type=int, default=16)
    parser.add_argument("--row-tokens", type=int, default=49152, help="extract's default --token-budget")
    parser.add_argument("--work", type=Path, default=Path("/tmp/warmup-bench"))
    parser.add_argument(
        "--runs", default="cold,warm", help="cold (an empty kernel cache), then warm (the cache it filled); '' for none"
    )
    parser.add_argument(
        "--compile-log", type=Path, help="then a cold warm-up in this process, each compilation logged here"
    )
    args = parser.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    target, kernels = args.work / "target", args.work / "kernels"
    config = target_config("qwen3.6-27b-cut", args.layers_cut)
    config.save_pretrained(target)
    for run in filter(None, args.runs.split(",")):
        started = time.perf_counter()
        process = start_background_warmup(target, PackedLayout(args.row_tokens), "cuda", kernels, config)
        if process is None:
            raise SystemExit("this benchmark needs a CUDA GPU")
        process.join()
        print(
            f"{run}: exit code {process.exitcode}, {time.perf_counter() - started:.1f} s from the process start",
            flush=True,
        )
    if args.compile_log:
        shutil.rmtree(kernels, ignore_errors=True)
        log_compilations(
            args.compile_log, lambda: warm_up_small_model(target, PackedLayout(args.row_tokens), "cuda", kernels)
        )


def log_compilations(path: Path, warm_up) -> None:
    from triton import knobs

    started, compiles = time.perf_counter(), []

    def on_compile(*, src, metadata, times, cache_hit, **_) -> None:
        compiles.append(
            {
                "kernel": src.name,
                "num_warps": metadata.get("num_warps"),
                "num_stages": metadata.get("num_stages"),
                "seconds": times.total / 1e6,
                "ended_s": time.perf_counter() - started,
                "cache_hit": cache_hit,
                "stages_s": {stage: us / 1e6 for stage, us in times.lowering_stages},
            }
        )

    knobs.compilation.listener = on_compile
    try:
        warm_up()
    finally:
        knobs.compilation.listener = None
    path.write_text(json.dumps(compiles, indent=1))
    made = [c for c in compiles if not c["cache_hit"]]
    ends = [c["ended_s"] for c in made]
    print(
        f"compile log: {len(made)} compilations ({len(compiles) - len(made)} from disk), {sum(c['seconds'] for c in made):.1f} s "
        f"in all, ending {min(ends, default=0):.1f}-{max(ends, default=0):.1f} s after the start; the slowest:",
        flush=True,
    )
    for c in sorted(made, key=lambda c: -c["seconds"])[:10]:
        print(
            f"  {c['seconds']:6.2f} s  {c['kernel']} warps {c['num_warps']} stages {c['num_stages']}, ended at {c['ended_s']:.1f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
