"""The loader's host stage on the CPU: reader-thread throughput, and what reader threads cost the
thread that drives the GPU through the GIL (Linux: reads /proc/thread-self).

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
   its op rate; how often it went to sleep (it sleeps only to wait for the GIL) per row read; and the
   fraction of its wall time asleep (wall less time on a CPU and time waiting for one, per the
   kernel's schedstat), also per 1000 tokens read. Where cores are few and shared the op rate drops
   because the threads take CPU, and the time asleep grows when a thread holding the GIL loses its
   CPU; the count of waits depends least on the machine. Each case runs three times, interleaved;
   medians are printed.
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
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from benchmarks.gil_contention import PLANES, main_thread_rate
from benchmarks.train import write_cache
from dflash_cache.drafter.config_file import load_drafter_config
from dflash_cache.stream.caches import CacheSet
from dflash_cache.stream.loader import empty_host_batch, fill_row


@dataclass
class MainThread:
    ops_s: float
    asleep: float  # fraction of wall time
    sleeps: int
    calls: int  # work calls the other threads finished
    tokens: int  # what they returned, summed


def thread_clock() -> tuple[float, int]:
    """(seconds this thread was on a CPU or waiting for one, times it went to sleep)."""
    on_cpu, waiting = Path("/proc/thread-self/schedstat").read_text().split()[:2]
    status = Path("/proc/thread-self/status").read_text()
    sleeps = int(status.split("voluntary_ctxt_switches:")[1].split()[0])
    return (int(on_cpu) + int(waiting)) / 1e9, sleeps


def main_thread_beside(work: Callable[[int], int] | None, threads: int, seconds: float) -> MainThread:
    """The main thread's op rate and sleeps while `threads` threads call work(0), work(1), ... (alone
    when `work` is None)."""
    stop = threading.Event()
    calls, tokens = [0] * threads, [0] * threads

    def loop(first: int) -> None:
        i = first
        while not stop.is_set():
            tokens[first] += work(i)
            calls[first] += 1
            i += threads

    pool = [threading.Thread(target=loop, args=(t,)) for t in range(threads if work else 0)]
    for t in pool:
        t.start()
    wall, (scheduled, sleeps) = time.perf_counter(), thread_clock()
    rate = main_thread_rate(seconds)
    wall, (scheduled_after, sleeps_after) = time.perf_counter() - wall, thread_clock()
    stop.set()
    for t in pool:
        t.join()
    return MainThread(
        rate, max(0.0, 1 - (scheduled_after - scheduled) / wall), sleeps_after - sleeps, sum(calls), sum(tokens)
    )


def measure(caches: CacheSet, workers: int, seconds: float) -> dict:
    batch = empty_host_batch(caches, range(len(caches)), pin=False)
    rows = len(batch.keys)
    mb = batch.planes.numel() / 1e6
    for _ in range(2):
        wall, cpu = time.perf_counter(), time.thread_time()
        for i in range(rows):
            fill_row(caches, batch, i)
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    result = {
        "rows": rows,
        "tokens": sum(caches.lengths),
        "planes_mb": mb,
        "mb_s_wall": mb / wall,
        "mb_s_cpu": mb / cpu,
    }
    print(
        f"cache: {rows} rows, {result['tokens']} tokens, {caches.width * 2} raw bytes per token; one thread: "
        f"{mb / wall:,.0f} MB/s of planes (wall), {mb / cpu:,.0f} MB/s per CPU second",
        flush=True,
    )

    def read_row(i: int) -> int:
        fill_row(caches, batch, i % rows)
        return caches.lengths[batch.keys[i % rows]]

    def gil_free(i: int) -> int:
        zlib.crc32(PLANES)
        return 0

    cases = {"alone": None, "readers": read_row, "gil_free": gil_free}
    runs: dict[str, list[MainThread]] = {name: [] for name in cases}
    for _ in range(3):
        for name, work in cases.items():
            runs[name].append(main_thread_beside(work, workers, seconds))

    def median(name: str, f: Callable[[MainThread], float]) -> float:
        return statistics.median(f(r) for r in runs[name])

    for name in cases:
        result[name] = {
            "ops_s": median(name, lambda r: r.ops_s),
            "asleep": median(name, lambda r: r.asleep),
            "sleeps_per_call": median(name, lambda r: r.sleeps / max(r.calls, 1)),
            "runs": [asdict(r) for r in runs[name]],
        }
    result["readers"]["asleep_ms_per_1k_tokens"] = median(
        "readers", lambda r: r.asleep * seconds * 1e6 / max(r.tokens, 1)
    )
    alone, readers, free = result["alone"], result["readers"], result["gil_free"]
    print(
        f"main thread alone: {alone['ops_s']:,.0f} ops/s\n"
        f"beside {workers} reader thread(s): {readers['ops_s'] / alone['ops_s']:.2f} of that; {readers['sleeps_per_call']:.1f} GIL waits "
        f"per row read; asleep {readers['asleep']:.1%} of the time, {readers['asleep_ms_per_1k_tokens']:.2f} ms per 1000 tokens read\n"
        f"beside {workers} GIL-free thread(s): {free['ops_s'] / alone['ops_s']:.2f}; {free['sleeps_per_call']:.1f} GIL waits per call; "
        f"asleep {free['asleep']:.1%}",
        flush=True,
    )
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
