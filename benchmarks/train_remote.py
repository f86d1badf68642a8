"""Drafter training fed from a cache in object storage against the same cache on local disk, same run.

    pip install -e ".[test]"   # s3fs and moto's S3 server
    PYTHONPATH=. python benchmarks/train_remote.py [--preset qwen3.6-27b] [--batches 12] [--steps 24] [--json FILE]

The synthetic cache of benchmarks/train.py (bf16-zstd, 5 layers x hidden 5120, samples of 1000-4000
tokens) is written to local disk, then uploaded to moto's S3 server started on a free localhost port
in a separate process. The same batches then feed the same eager drafter step through the
prefetching loader, --steps steps after 3 warm-up steps each, from (a) the local folder, (b) S3 by
byte ranges (one request per sample), and (c) S3 with whole shards fetched into a local folder
(`--local-cache`), every shard fetched before the timed steps (the fetch is timed on its own).
The server is moto's, written in Python: a real object store serves more bandwidth, so (b) is a
lower bound on what S3 gives. Moto answers a range request by reading and copying the whole object,
so the cache is written in shards of 64 MB (extraction's default is 512 MB): with 1 GB shards every
sample read copies a gigabyte, and even a run of 4 batches takes minutes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.train import make_step, run_parser, timed, write_cache
from dflash_cache.data.plan import plan_batches
from dflash_cache.drafter.config_file import load_drafter_config
from dflash_cache.stream.caches import CacheSet
from dflash_cache.stream.loader import Loader


def start_s3_server() -> subprocess.Popen:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
    )
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return server
        except OSError:
            time.sleep(0.1)
    server.kill()
    raise RuntimeError("moto's S3 server did not start")


def main() -> None:
    args = run_parser(__doc__).parse_args()
    config = load_drafter_config(args.preset)
    work = Path(tempfile.mkdtemp(prefix="bench-train-remote-"))
    write_cache(work / "cache", config, args.batches * args.tokens, args.device, shard_bytes=64 << 20)
    server = start_s3_server()
    try:
        import fsspec

        fs = fsspec.filesystem("s3")
        fs.mkdir("bench")
        started = time.perf_counter()
        fs.put(f"{work / 'cache'}/", "bench/cache", recursive=True)
        upload_s = time.perf_counter() - started
        sources = {
            "local disk": ([str(work / "cache")], {}),
            "s3, byte ranges": (["s3://bench/cache"], {}),
            "s3, whole shards": (["s3://bench/cache"], {"local_dir": work / "fetched"}),
        }
        step = make_step(config, args.device)
        results, fetch_s = {}, 0.0
        for name, (paths, kw) in sources.items():
            caches = CacheSet(paths, **kw)
            keys = list(range(len(caches.lengths)))
            batches = plan_batches(keys, caches.lengths, args.tokens, seed=0)[: args.batches]
            cycle = (batches * (args.steps // len(batches) + 2))[: args.steps + 3]
            if kw:
                started = time.perf_counter()
                for cache in caches.caches:
                    for shard in cache.shards:
                        cache.read_stored(shard.sample_ids[0])
                fetch_s = time.perf_counter() - started
                print(f"fetched every shard in {fetch_s:.1f} s", flush=True)
            with Loader(caches, cycle, args.device, prefetch=4, workers=args.workers) as loader:
                results[name], _ = timed(step, loader, args.steps, args.anchors, args.device)
            caches.close()
            print(f"{name:18s} {results[name]:,.0f} tokens/s", flush=True)
        stored = sum(p.stat().st_size for p in (work / "cache" / "shards").iterdir())
        print(f"cache: {stored / 1e9:.2f} GB, uploaded to the local S3 server in {upload_s:.1f} s", flush=True)
        if args.json:
            args.json.write_text(
                json.dumps(
                    {"tok_s": results, "fetch_s": fetch_s, "stored_gb": stored / 1e9, "upload_s": upload_s}, indent=2
                )
            )
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    main()
