"""Scale on the CPU: the data front end at 10K-1M samples, and training's start on 100,000 shards.

    PYTHONPATH=. python benchmarks/scale.py [--sizes 10000,100000,1000000] [--world 8] [--work DIR]
                                            [--shards 100000] [--json FILE]

1. Tokenization throughput: the bundled conversations (examples/assets/data/train.jsonl, repeated to
   --tokenize-records records) through the bundled tokenizer (examples/assets/target), building the
   tokenized-data cache with 1 process, 2 and every core: tokens/s, and the factor over one process.
2. For each size N: a synthetic pre-tokenized Arrow file of N samples, lengths lognormal around 2,600
   tokens (median 2,600, sigma 0.6, cut to 1..8192). `extract` runs as each of --world torchrun ranks
   in turn (RANK/WORLD_SIZE set, one process at a time, so that few cores suffice), and once as a single
   process, up to the point where the worker would load the target: the plan is made and the rank's
   samples are ready (the worker's first pass over them, the sizes of its batches, is done, and the
   first batch's tokens are read). The target's loading is left out. Reported per rank: seconds from
   the process start to that point, and peak resident memory (anonymous: RssAnon, and ru_maxrss), for a
   fresh extraction (rank 0 tokenizes and makes the plan, which is kept beside the tokenized data; in a
   real torchrun the other ranks wait for it, here they run after it) and for a resumed one (journals
   list half the samples as committed, 5 to a shard record as 512 MiB shards hold; the tokenized data
   and the plan exist). The single process also finds the plan made: it is compared with a rank as
   a run that holds everything itself, not as one that pays for planning.
3. Time to the first training step on a cache of --shards one-row shards (tiny rows: the manifest's
   size and the first batch's reads are measured, not the rows' decompression), with the tiny test drafter.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

START = time.perf_counter()
ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "examples" / "assets"
ANON = None  # AnonPeak of a child process
TARGET = ASSETS / "target"


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class AnonPeak:
    """The peak of this process's anonymous resident memory (RssAnon: what it holds, not the pages of
    files it maps, which the kernel can drop), sampled every 20 ms on a thread."""

    def __init__(self):
        import threading

        self.peak = 0.0
        threading.Thread(target=self._run, daemon=True).start()

    @staticmethod
    def now() -> float:
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def _run(self) -> None:
        while True:
            self.peak = max(self.peak, self.now())
            time.sleep(0.02)

    def mark(self) -> float:
        self.peak = max(self.peak, self.now())
        return self.peak


def child(args: list[str], env: dict | None = None) -> dict:
    """Run this script in a fresh process with `args`; its last stdout line is a JSON result."""
    result = subprocess.run(
        [sys.executable, __file__, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )
    if result.returncode != 0:
        raise RuntimeError(f"{args}: {result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# ---- 1. tokenization throughput -------------------------------------------------------------------


def tokenize_throughput(work: Path, records: int) -> dict:
    lines = (ASSETS / "data" / "train.jsonl").read_text().splitlines()
    data = work / "conversations.jsonl"
    with open(data, "w") as f:
        for i in range(records):
            f.write(lines[i % len(lines)] + "\n")
    cores = os.cpu_count() or 1
    rows = {}
    for workers in sorted({1, 2, cores}):
        load, busy = (
            os.getloadavg()[0],
            busy_cpu_s(),
        )  # other work on the machine: the figures mean little when it is high
        row = child(["--child-tokenize", str(data), str(work / f"tok-{workers}"), str(workers)])
        others = busy_cpu_s() - busy - row["cpu_s"]  # CPU time of every other process during the run (imports included)
        rows[workers] = {
            **row,
            "load_before": load,
            "load_after": os.getloadavg()[0],
            "other_cores": max(0.0, others) / row["wall_s"],
        }
    one = rows[1]["tokens_per_s"]
    return {
        "records": records,
        "cores": cores,
        "runs": [{**r, "workers": w, "factor": r["tokens_per_s"] / one} for w, r in rows.items()],
    }


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has been busy (/proc/stat: all but idle and iowait)."""
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def run_child_tokenize(data: str, folder: str, workers: int) -> dict:
    from transformers import AutoTokenizer

    from dflash_cache.data.tokenized import tokenized_data
    from dflash_cache.extract.spec import tokenizer_hash

    tokenizer = AutoTokenizer.from_pretrained(TARGET, local_files_only=True)
    cpu = lambda who: (lambda u: u.ru_utime + u.ru_stime)(resource.getrusage(who))  # noqa: E731
    started, main_cpu = time.perf_counter(), cpu(resource.RUSAGE_SELF)
    out = tokenized_data([data], tokenizer, 8192, tokenizer_hash(TARGET), Path(folder), workers=workers)
    seconds = time.perf_counter() - started
    main_cpu = cpu(resource.RUSAGE_SELF) - main_cpu
    cpu_s = main_cpu + cpu(resource.RUSAGE_CHILDREN)  # the pool's processes have been joined
    tokens = int(out.lengths.sum())
    total = cpu(resource.RUSAGE_SELF) + cpu(resource.RUSAGE_CHILDREN)  # imports included
    return {
        "samples": len(out.lengths),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "cpu_s": total,
        "tokenize_cpu_s": cpu_s,
        "tokens_per_cpu_s": tokens / cpu_s,
        "main_cpu_s": main_cpu,
        "wall_s": time.perf_counter() - START,
    }


# ---- 2. the front end of an extraction --------------------------------------------------------------


def synthetic_data(path: Path, samples: int, vocab: int, seed: int = 0) -> int:
    """Pre-tokenized Arrow IPC file, written in chunks; returns its tokens."""
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(np.log(2600), 0.6, samples)), 1, 8192).astype(np.int64)
    schema = pa.schema([("input_ids", pa.list_(pa.int32()))])
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for start in range(0, samples, 4096):
            part = lengths[start : start + 4096]
            offsets = np.concatenate([[0], np.cumsum(part)]).astype(np.int32)
            values = rng.integers(0, vocab, int(offsets[-1]), dtype=np.int32)
            writer.write_batch(pa.record_batch([pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))], schema))
    return int(lengths.sum())


def run_child_extract(data: str, out: str, tokenized: str) -> dict:
    """`extract` up to the worker's start; prints seconds since this process started and peak RSS."""
    import dflash_cache.extract.pipeline as pipeline

    probe = {"import_s": time.perf_counter() - START, "import_rss_mb": peak_rss_mb(), "import_anon_mb": ANON.mark()}

    def first_forward(jobs, on_progress):
        job = jobs[0]
        # What the worker does before its first forward: the size of its largest batch over its samples,
        # then the first batch's tokens, to the device.
        largest = max((sum(len(job.samples[sid].input_ids) for sid in batch) for batch in job.batches), default=0)
        first = sum(int(job.samples[sid].input_ids.sum() >= 0) for sid in job.batches[0]) if job.batches else 0
        probe.update(
            seconds=time.perf_counter() - START,
            peak_rss_mb=peak_rss_mb(),
            anon_peak_mb=ANON.mark(),
            rank=job.rank,
            batches=len(job.batches),
            samples=len(job.samples),
            largest_batch=largest,
            first_batch=first,
            spec=job.spec,
        )
        raise SystemExit(0)

    pipeline._run_jobs = first_forward
    opts = pipeline.ExtractOptions(
        target=TARGET,
        data=[Path(data)],
        out=Path(out),
        layers=[1, 2],
        token_budget=49152,
        max_length=8192,
        tokenized_dir=Path(tokenized),
    )
    try:
        pipeline.extract(opts)
    except SystemExit:
        pass
    return probe


def write_half_journal(out: Path, spec: dict, samples: int, per_shard: int = 5) -> None:
    """Journals of a run that committed the first half of the samples, `per_shard` to a shard record
    (512 MiB shards of ~35 KB a token hold ~5 samples of 3,000 tokens). The shard files themselves
    are not needed before the first forward of a resumed run."""
    from dflash_cache.store.journal import JOURNAL_DIR
    from dflash_cache.store.shard import SHARD_DIR, shard_name

    (out / JOURNAL_DIR).mkdir(parents=True, exist_ok=True)
    with open(out / JOURNAL_DIR / "r0.jsonl", "w") as f:
        f.write(json.dumps({"spec": spec}) + "\n")
        for index, start in enumerate(range(0, samples // 2, per_shard)):
            ids = list(range(start, min(start + per_shard, samples // 2)))
            record = {
                "path": f"{SHARD_DIR}/{shard_name(0, index)}",
                "rows": len(ids),
                "tokens": len(ids),
                "bytes": 1,
                "hidden_bytes": 1,
                "sha256": "0" * 64,
                "sample_ids": ids,
                "num_tokens": [1] * len(ids),
            }
            f.write(json.dumps({"shard": record}) + "\n")


def front_end(work: Path, samples: int, world: int) -> dict:
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(TARGET, local_files_only=True))
    folder = work / f"front-{samples}"
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "data.arrow"
    started = time.perf_counter()
    tokens = synthetic_data(data, samples, vocab)
    result = {
        "samples": samples,
        "tokens": tokens,
        "data_gb": data.stat().st_size / 1e9,
        "write_data_s": time.perf_counter() - started,
    }
    tokenized = folder / "tokenized"
    ranks = lambda out: [
        child(
            ["--child-extract", str(data), str(out), str(tokenized)],  # noqa: E731
            {"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": "0"},
        )
        for r in range(world)
    ]
    result["fresh"] = ranks(folder / "fresh")
    result["single_process"] = child(["--child-extract", str(data), str(folder / "single"), str(tokenized)])
    spec = result["single_process"].pop("spec")
    for name in ("resumed", "single_resumed"):
        write_half_journal(folder / name, spec, samples)
    result["resumed"] = ranks(folder / "resumed")
    result["single_resumed"] = child(["--child-extract", str(data), str(folder / "single_resumed"), str(tokenized)])
    result["single_resumed"].pop("spec")
    for r in result["fresh"] + result["resumed"]:
        r.pop("spec", None)
    shutil.rmtree(folder)
    return result


# ---- 3. time to the first training step ---------------------------------------------------------------


def first_step(work: Path, shards: int) -> dict:
    from tests.cachegen import random_spec, write_one_row_shards
    from tests.test_train_helpers import HIDDEN, LAYERS, VOCAB, drafter_json, write_head

    cache = work / "shards-cache"
    started = time.perf_counter()
    lengths = [16 + i % 49 for i in range(shards)]
    write_one_row_shards(cache, lengths, random_spec(layer_ids=LAYERS, hidden_size=HIDDEN, vocab_size=VOCAB))
    write_head(cache)
    drafter_json(work / "drafter.json")
    written = time.perf_counter() - started
    result = child(["--child-train", str(cache), str(work / "run"), str(work / "drafter.json")])
    manifest_mb = (cache / "manifest.json").stat().st_size / 1e6
    shutil.rmtree(cache)
    return {"shards": shards, "write_s": written, "manifest_mb": manifest_mb, **result}


def run_child_train(cache: str, out: str, drafter: str) -> dict:
    import dflash_cache.train.train as train_module
    from dflash_cache.train.config import TrainConfig

    probe = {"import_s": time.perf_counter() - START, "import_rss_mb": peak_rss_mb(), "import_anon_mb": ANON.mark()}
    real_step = train_module.train_step

    def step(*args, **kwargs):
        if "seconds" not in probe:
            probe.update(seconds=time.perf_counter() - START, peak_rss_mb=peak_rss_mb(), anon_peak_mb=ANON.mark())
        return real_step(*args, **kwargs)

    train_module.train_step = step
    cfg = TrainConfig(
        caches=[cache],
        out=out,
        drafter=drafter,
        cpu_procs=1,
        token_budget=4096,
        steps=1,
        max_anchors=8,
        eval_fraction=0.0,
        save_every=0,
    )
    train_module.train(cfg, echo=lambda line: None)
    return probe


# ---- report -------------------------------------------------------------------------------------------------


def figures(r: dict) -> str:
    """Time from the process start (of which after the imports); peak anonymous memory (of which
    over the imports) and peak RSS, mapped files included."""
    return (
        f"{r['seconds']:.1f} s ({r['seconds'] - r['import_s']:.1f} s after imports), anon peak "
        f"{r['anon_peak_mb']:,.0f} MB (+{r['anon_peak_mb'] - r['import_anon_mb']:,.0f} over imports), "
        f"RSS peak {r['peak_rss_mb']:,.0f} MB"
    )


def worst(rows: list[dict]) -> str:
    slowest = max(rows, key=lambda r: r["seconds"] - r["import_s"])
    biggest = max(rows, key=lambda r: r["anon_peak_mb"] - r["import_anon_mb"])
    return (
        f"{slowest['seconds'] - slowest['import_s']:.1f} s after imports, anon "
        f"+{biggest['anon_peak_mb'] - biggest['import_anon_mb']:,.0f} MB over imports, "
        f"RSS peak {max(r['peak_rss_mb'] for r in rows):,.0f} MB"
    )


def report(results: dict) -> list[str]:
    lines = []
    t = results["tokenize"] or {"records": 0, "cores": os.cpu_count(), "runs": []}
    lines.append(f"tokenization, {t['records']} bundled conversations, {t['cores']} cores:")
    for r in t["runs"]:
        lines.append(
            f"  {r['workers']} process(es): {r['tokens_per_s']:,.0f} tokens/s ({r['tokens']:,} tokens in "
            f"{r['seconds']:.1f} s), x{r['factor']:.2f} one process; {r['tokens_per_cpu_s']:,.0f} tokens per "
            f"CPU-second, main process busy {r['main_cpu_s'] / r['seconds']:.0%} of the time; load average "
            f"{r['load_before']:.2f} before, {r['load_after']:.2f} after; other processes used "
            f"{r['other_cores']:.2f} cores meanwhile"
        )
    for f in results["front_end"]:
        lines.append(f"front end, {f['samples']:,} samples, {f['tokens']:,} tokens ({f['data_gb']:.1f} GB of data):")
        for name in ("fresh", "resumed"):
            rows = f[name]
            lines.append(f"  {name:8s} rank 0: {figures(rows[0])}; ranks 1-{len(rows) - 1}, worst: {worst(rows[1:])}")
        lines.append(f"  single process, fresh (tokenized data kept): {figures(f['single_process'])}")
        lines.append(f"  single process, resumed: {figures(f['single_resumed'])}")
        over = lambda r: r["anon_peak_mb"] - r["import_anon_mb"]  # noqa: E731
        world = len(f["fresh"])
        for name, rows, one in (
            ("fresh", f["fresh"][1:], f["single_process"]),
            ("resumed", f["resumed"], f["single_resumed"]),
        ):
            rank, one = max(map(over, rows)), over(one)
            lines.append(
                f"  {name}: anon over imports, worst rank{' but 0' if name == 'fresh' else ''} +{rank:,.0f} MB; one process "
                f"+{one:,.0f} MB, 1/{world} of it {one / world:,.0f} MB; the difference {rank - one / world:+,.0f} MB"
            )
    s = results.get("first_step")
    if s:
        lines.append(
            f"first training step, {s['shards']:,} one-row shards ({s['manifest_mb']:.0f} MB manifest): {figures(s)}"
        )
    return lines


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1].startswith("--child-"):
        global ANON
        ANON = AnonPeak()
        kind, rest = sys.argv[1], sys.argv[2:]
        run = {
            "--child-tokenize": lambda: run_child_tokenize(rest[0], rest[1], int(rest[2])),
            "--child-extract": lambda: run_child_extract(*rest),
            "--child-train": lambda: run_child_train(*rest),
        }[kind]
        print(json.dumps(run()))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--tokenize-records", type=int, default=20_000)
    parser.add_argument("--shards", type=int, default=100_000)
    parser.add_argument("--work", type=Path, help="Scratch folder (default: a temporary one, deleted after).")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dflash-scale-", dir=args.work))
    try:
        results = {
            "tokenize": tokenize_throughput(work, args.tokenize_records) if args.tokenize_records else None,
            "front_end": [],
        }
        print("\n".join(report(results)), flush=True)
        for size in (int(s) for s in args.sizes.split(",") if s):
            results["front_end"].append(front_end(work, size, args.world))
            print("\n".join(report(results)[-7:]), flush=True)
        if args.shards:
            results["first_step"] = first_step(work, args.shards)
        print("\n" + "\n".join(report(results)))
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
