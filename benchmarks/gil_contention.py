"""How much a compression thread slows the thread that drives the GPU, through the GIL (CPU only).

    python benchmarks/gil_contention.py [--seconds 3]

The main thread issues small torch ops in a loop (as a forward pass issues kernel launches: each
needs the GIL). A second thread compresses an 80 MB bf16-zstd payload over and over, either the way
extraction first did it (join the zstd frame and the raw low-byte plane as Python bytes, then copy
them into an Arrow array: bulk copies under the GIL) or the way `store/codecs.compress` and
`Row.record_batch` do it now (numpy copies, which release the GIL; zero-copy Arrow buffers).
Printed: the main thread's op rate alone and beside each variant.
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np
import pyarrow as pa
import torch
import zstandard

from dflash_cache.store.codecs import compress

PLANES = np.random.default_rng(0).integers(0, 256, 80_000_000, dtype=np.uint8)


def joined_bytes() -> None:
    half = len(PLANES) // 2
    payload = zstandard.ZstdCompressor(level=1).compress(PLANES[:half]) + PLANES[half:].tobytes()
    pa.array([payload], pa.large_binary())


def numpy_buffers() -> None:
    payload = compress(PLANES, "bf16-zstd")
    offsets = pa.py_buffer(np.array([0, len(payload)], dtype=np.int64))
    pa.LargeBinaryArray.from_buffers(pa.large_binary(), 1, [None, offsets, pa.py_buffer(payload)])


def main_thread_rate(seconds: float) -> float:
    x = torch.zeros(16, 16)
    ops, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(100):
            x.add_(1.0)
        ops += 100
    return ops / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    alone = main_thread_rate(args.seconds)
    print(f"main thread alone: {alone:,.0f} ops/s")
    for name, work in [("beside joined bytes (before)", joined_bytes), ("beside numpy buffers (now)", numpy_buffers)]:
        stop = threading.Event()

        def loop(work=work, stop=stop) -> None:
            while not stop.is_set():
                work()

        worker = threading.Thread(target=loop)
        worker.start()
        rate = main_thread_rate(args.seconds)
        stop.set()
        worker.join()
        print(f"main thread {name}: {rate:,.0f} ops/s ({rate / alone:.2f} of alone)")


if __name__ == "__main__":
    main()
