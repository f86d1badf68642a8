"""The loader's host stage on the CPU: reader-thread throughput, and what reader threads cost the
thread that drives the GPU through the GIL (Linux: reads /proc/thread-self/schedstat).

    PYTHONPATH=. python benchmarks/loader_host.py [--hidden 2560] [--tokens 40000] [--workers 1]
                                                  [--seconds 3] [--json FILE]

A synthetic bf16-zstd cache like benchmarks/train.py's (the qwen3.6-27b preset's 5 layers, samples of
1000-4000 tokens; hidden --hidden, 5120 for the real width where the RAM allows) is written, then read
from the page cache:

1. Throughput: one thread fills every row of a host batch (`loader.fill_row`: read, verify,
   decompress), twice; MB/s of decompressed planes on the second pass, over wall and thread CPU time.
2. GIL: the main thread issues small torch ops (`gil_contention.main_thread_rate`: every op releases
   and retakes the GIL, as kernel launches do) alone, beside --workers threads filling rows over and
   over, and beside as many threads doing GIL-free work only (zlib.crc32 of a large buffer). Printed:
   its op rate and the fraction of its wall time spent waiting for the GIL (wall time less time on a
   CPU and time waiting for one, per the kernel's schedstat). On a machine with few, shared cores
   the op rate also drops because the threads take CPU; the GIL wait does not depend on that. Each
   case runs three times, interleaved; medians are printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.gil_contention import PLANES, main_thread_rate
from benchmarks.train import write_cache
from dflash_cache.drafter.config import load_drafter_config
from dflash_cache.stream.caches import CacheSet
from dflash_cache.stream.loader import empty_host_batch, fill_row


def scheduled_seconds() -> float:
    """This thread's time on a CPU plus its time runnable but waiting for one."""
    on_cpu, waiting = Path("/proc/thread-self/schedstat").read_text().split()[:2]
    return (int(on_cpu) + int(waiting)) / 1e9


def main_thread_beside(work: Callable[[int], None] | None, threads: int, seconds: float) -> tuple[float, float]:
    """(op rate, fraction of wall time waiting for the GIL) of this thread while `threads` threads call
    work(0), work(1), ... (alone when `work` is None)."""
    stop = threading.Event()

    def loop(first: int) -> None:
        i = first
        while not stop.is_set():
            work(i)
            i += threads

    pool = [threading.Thread(target=loop, args=(t,)) for t in range(threads if work else 0)]
    for t in pool:
        t.start()
    wall, scheduled = time.perf_counter(), scheduled_seconds()
    rate = main_thread_rate(seconds)
    wall, scheduled = time.perf_counter() - wall, scheduled_seconds() - scheduled
    stop.set()
    for t in pool:
        t.join()
    return rate, max(0.0, 1 - scheduled / wall)


def measure(caches: CacheSet, workers: int, seconds: float) -> dict:
    batch = empty_host_batch(caches, range(len(caches)), pin=False)
    rows = len(batch.keys)
    mb = batch.planes.numel() / 1e6
    for _ in range(2):
        wall, cpu = time.perf_counter(), time.thread_time()
        for i in range(rows):
            fill_row(caches, batch, i)
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    result = {"rows": rows, "tokens": sum(caches.lengths), "planes_mb": mb, "mb_s_wall": mb / wall, "mb_s_cpu": mb / cpu}
    print(f"cache: {rows} rows, {result['tokens']} tokens, {caches.width * 2} raw bytes per token; one thread: "
          f"{mb / wall:,.0f} MB/s of planes (wall), {mb / cpu:,.0f} MB/s per CPU second", flush=True)

    cases = {"alone": None, "readers": lambda i: fill_row(caches, batch, i % rows), "gil_free": lambda i: zlib.crc32(PLANES)}
    runs = {name: [] for name in cases}
    for _ in range(3):
        for name, work in cases.items():
            runs[name].append(main_thread_beside(work, workers, seconds))
    for name, values in runs.items():
        rate, wait = (statistics.median(v) for v in zip(*values))
        result[name] = {"ops_s": rate, "gil_wait": wait}
    alone = result["alone"]["ops_s"]
    print(f"main thread: alone {alone:,.0f} ops/s; beside {workers} reader thread(s) "
          f"{result['readers']['ops_s'] / alone:.2f} of that, {result['readers']['gil_wait']:.1%} of its time waiting for the GIL; "
          f"beside {workers} GIL-free thread(s) {result['gil_free']['ops_s'] / alone:.2f}, {result['gil_free']['gil_wait']:.1%}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3.6-27b")
    parser.add_argument("--hidden", type=int, default=2560)
    parser.add_argument("--tokens", type=int, default=40000)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = replace(load_drafter_config(args.preset), hidden_size=args.hidden, target_hidden_size=args.hidden)
    with tempfile.TemporaryDirectory(prefix="bench-loader-host-") as tmp:
        write_cache(Path(tmp), config, args.tokens, "cpu")
        result = measure(CacheSet([tmp]), args.workers, args.seconds)
    if args.json:
        args.json.write_text(json.dumps({"hidden": args.hidden, "workers": args.workers, **result}, indent=2))


if __name__ == "__main__":
    main()
