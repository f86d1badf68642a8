"""What the tokenizer pool's start and the tokenized data's checks cost.

    PYTHONPATH=. python -m benchmarks.tokenize_pool [--target DIR] [--records 2048] [--repeats 3] [--tokens 200000000]

1. Start-up: in a new process per run, as `python -m dflash_cache_cli.main` is (the CLI's main module
   imported), the time from the pool's creation to its first chunk of records tokenized and the
   time for all --records bundled-style conversations, with 2 workers, for workers forked from the
   run ("fork", as before) and from a forkserver (what the pool does); runs alternate.
2. Reuse: a tokenized-data entry of --tokens random token ids (lengths around 2,000) is written
   with the build's own code, then opened as a resume opens it: the CRC-32 of the Arrow file and
   the token ids' range check, against the time of opening it with both left out.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

import dflash_cache_cli.main  # noqa: F401  the CLI's main module, which every worker imports again
from dflash_cache.data import dataset, tokenized
from dflash_cache.data.readers import read_records


def pool_start(method: str, target: str, data: Path) -> dict:
    from transformers import AutoTokenizer

    if method == "fork":
        dataset._pool_context = lambda tokenizer: multiprocessing.get_context("fork")
    tokenizer = AutoTokenizer.from_pretrained(target)
    records = list(read_records(data, skip_bad=True, max_line_bytes=1 << 22, parse_json=False))
    start = time.perf_counter()
    chunks = dataset._encode_chunks(
        dataset._chunks(iter(records), dataset.CHUNK_RECORDS), tokenizer, len(tokenizer), dataset.EncodeOptions(2048), 2
    )
    next(chunks)
    first = time.perf_counter() - start
    for _ in chunks:
        pass
    return {"method": method, "first_chunk_s": round(first, 2), "all_s": round(time.perf_counter() - start, 2)}


def reuse(tokens: int, folder: Path) -> dict:
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(2000), 0.5, tokens // 2000 + 1), 16, 8192).astype(np.int64)
    lengths = lengths[np.cumsum(lengths) <= tokens]
    path = folder / "entry.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, tokenized.SCHEMA) as writer:
        for start in range(0, len(lengths), 256):
            writer.write_batch(
                tokenized._record_batch(
                    [
                        dataset.Sample(start + i, rng.integers(0, 150_000, n, dtype=np.int32), np.ones(n, dtype=bool))
                        for i, n in enumerate(lengths[start : start + 256])
                    ]
                )
            )
    out = {"tokens": int(lengths.sum()), "arrow_bytes": path.stat().st_size}
    tokenized._checksum(path)  # the page cache holds the file for every timing below
    for name, check in (("open_s", False), ("open_checked_s", True)):
        start = time.perf_counter()
        if check:
            tokenized._checksum(path)
        reader = pa.ipc.open_file(pa.memory_map(str(path)))
        for batch in tokenized._batches(reader, path):
            if check:
                tokenized._check_ids(batch, 151_000, path)
        out[name] = round(time.perf_counter() - start, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="/work/models/smollm2")
    parser.add_argument("--records", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=200_000_000)
    parser.add_argument("--pool-start", nargs=2, metavar=("METHOD", "DATA"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pool_start:
        print(json.dumps(pool_start(args.pool_start[0], args.target, Path(args.pool_start[1]))))
        return
    from tests.support.tiny import write_conversations

    with tempfile.TemporaryDirectory() as work:
        data = write_conversations(Path(work) / "data.jsonl", count=args.records, seed=1)
        for _ in range(args.repeats):
            for method in ("fork", "forkserver"):
                run = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "benchmarks.tokenize_pool",
                        "--target",
                        args.target,
                        "--pool-start",
                        method,
                        str(data),
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                print(run.stdout.strip())
        print(json.dumps(reuse(args.tokens, Path(work))))


if __name__ == "__main__":
    main()
