"""One extraction rank: the target runs on this process's main thread; threads only compress and write.

    main thread   batch -> target forward (hooks) -> checks -> encode on the device -> async D2H
    thread pool   wait for the copy -> compress -> Row
    writer thread rows in order -> ShardWriter (tmp, fsync, rename, journal)

The queue between the main thread and the writer is bounded, so host memory stays bounded; the time
the main thread spends blocked on it is reported as time waiting on the disk.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dflash_cache import faults
from dflash_cache.data.dataset import Sample
from dflash_cache.errors import DFlashCacheError
from dflash_cache.extract.checks import check_sample
from dflash_cache.extract.head import save_target_files
from dflash_cache.extract.runner import TargetRunner
from dflash_cache.extract.split import Part, SampleOutOfMemory, run_with_split
from dflash_cache.extract.target import Target, load_target
from dflash_cache.store.codecs import compress, encode
from dflash_cache.store.integrity import hash_target_files
from dflash_cache.store.schema import Row
from dflash_cache.store.shard import ShardWriter
from dflash_cache.store.staging import Uploader


@dataclass
class RankJob:
    root: Path
    target_path: Path
    device: str
    rank: int
    spec: dict
    batches: list[list[int]]  # this rank's batches, whole (same composition in every run)
    samples: dict[int, Sample]  # the samples of those batches
    done: set[int]  # sample ids already committed or skipped: computed again but not written
    first_shard_index: int
    on_bad_sample: str = "error"
    max_shard_bytes: int = 512 << 20
    compress_threads: int = 4
    queue_depth: int = 8
    write_target_files: bool = False
    uploader: Uploader | None = None  # extraction to a remote cache: `root` is the staging folder


@dataclass
class Progress:
    """Increments sent to whoever displays progress."""

    rank: int
    samples: int = 0
    tokens: int = 0
    bytes: int = 0
    skipped: int = 0
    wait_s: float = 0.0  # main thread blocked on the writer (the disk is the bottleneck)


@dataclass
class RankSummary:
    rank: int
    samples: int = 0
    tokens: int = 0
    bytes: int = 0
    skipped: list[dict] = field(default_factory=list)
    compute_s: float = 0.0
    wait_s: float = 0.0


@dataclass
class _Skip:
    sample_id: int
    reason: str


@dataclass
class _HostCopy:
    """Device-to-host copies of one part's outputs, into pinned memory; `ready` says when done."""

    planes: torch.Tensor
    scales: torch.Tensor | None
    target_ids: torch.Tensor
    topk_ids: torch.Tensor | None
    topk_logprobs: torch.Tensor | None
    ready: torch.cuda.Event | None

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None or t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def _padded(samples: list[Sample], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([len(s.input_ids) for s in samples])
    ids = torch.zeros(len(samples), int(lengths.max()), dtype=torch.long)
    for b, s in enumerate(samples):
        ids[b, : len(s.input_ids)] = torch.from_numpy(s.input_ids.astype(np.int64))
    if device != "cpu":
        ids = ids.pin_memory().to(device, non_blocking=True)
    return ids, lengths


def _make_row(sample: Sample, copy: _HostCopy, start: int, stop: int, token_start: int, codec: str, layers: int) -> Row:
    copy.wait()
    faults.point("extract.compress")
    n = len(sample.input_ids)
    tokens = slice(token_start, token_start + n)
    row = Row(
        sample_id=sample.sample_id,
        input_ids=sample.input_ids,
        loss_mask=sample.loss_mask,
        target_ids=copy.target_ids[tokens].numpy().astype(np.int32),
        hidden=compress(copy.planes[start:stop].numpy(), codec),
        hidden_scales=None if copy.scales is None else copy.scales[tokens].numpy().tobytes(),
        topk_ids=None if copy.topk_ids is None else copy.topk_ids[tokens].numpy().astype(np.int32),
        topk_logprobs=None if copy.topk_logprobs is None else copy.topk_logprobs[tokens].numpy(),
    )
    row.record_batch  # noqa: B018 - build (and checksum) it here, in parallel, not on the writer thread
    return row


class _Writer(threading.Thread):
    """Takes lists of futures in order and appends their rows; keeps the first error it meets."""

    def __init__(self, writer: ShardWriter, report: Callable[[Progress], None], rank: int, depth: int):
        super().__init__(daemon=True, name=f"writer-r{rank}")
        self.writer, self.report, self.rank = writer, report, rank
        self.queue: queue.Queue[list[Future] | None] = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.summary = RankSummary(rank)

    def run(self) -> None:
        while (item := self.queue.get()) is not None:
            if self.error is not None:
                continue  # drain so the producer never blocks on a dead writer
            try:
                for future in item:
                    self._write(future.result())
            except OSError as e:  # a full disk or a file-size limit: the shard being written is dropped
                self.error = DFlashCacheError(f"writing to {self.writer.root} failed: {e.strerror or e}; free space "
                                              "(or raise the file-size limit) and rerun the same command to resume")
                self.writer.abort()
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                self.error = e
                self.writer.abort()

    def _write(self, row: Row | _Skip) -> None:
        if isinstance(row, _Skip):
            self.writer.skip(row.sample_id, row.reason)
            self.summary.skipped.append({"sample_id": row.sample_id, "reason": row.reason})
            self.report(Progress(self.rank, skipped=1))
            return
        size = len(row.hidden) + len(row.hidden_scales or b"")
        self.writer.append(row)
        self.summary.samples += 1
        self.summary.tokens += row.num_tokens
        self.summary.bytes += size
        self.report(Progress(self.rank, samples=1, tokens=row.num_tokens, bytes=size))

    def put(self, item: list[Future]) -> float:
        """Queue a part's futures; returns seconds spent waiting for room."""
        start = time.perf_counter()
        while True:
            if self.error is not None:
                raise self.error
            try:
                self.queue.put(item, timeout=0.5)
                return time.perf_counter() - start
            except queue.Full:
                continue

    def finish(self) -> None:
        self.queue.put(None)
        self.join()
        if self.error is not None:
            raise self.error
        self.writer.commit()


def run_rank(job: RankJob, report: Callable[[Progress], None] = lambda p: None, target: Target | None = None) -> RankSummary:
    """Extract this rank's batches; `target` may be given already loaded (benchmarks build one in place)."""
    target = target or load_target(job.target_path, job.device)
    if target.config_hash != job.spec["target"]["config_hash"]:
        raise DFlashCacheError(f"target {job.target_path} changed while extraction was starting")
    shards = ShardWriter(job.root, job.rank, job.spec, job.first_shard_index, job.max_shard_bytes,
                         on_journal=job.uploader or (lambda shard_path: None))
    if job.write_target_files:
        save_target_files(target, job.root / "target")
        if job.uploader is not None:
            job.uploader.upload_target()
        shards.record_target_files(hash_target_files(job.root / "target"))
    layer_ids = job.spec["layer_ids"]
    codec = job.spec["codec"]
    runner = TargetRunner(target, layer_ids, topk=job.spec["topk"])
    writer = _Writer(shards, report, job.rank, job.queue_depth)
    writer.start()
    pool = ThreadPoolExecutor(job.compress_threads, thread_name_prefix=f"compress-r{job.rank}")
    started = time.perf_counter()
    wait_s = 0.0
    try:
        for batch in job.batches:
            pending = list(batch)
            while pending and not all(sid in job.done for sid in pending):
                input_ids, lengths = _padded([job.samples[sid] for sid in pending], job.device)
                faults.point("extract.forward")
                try:
                    for part in run_with_split(runner, input_ids, lengths, pending):
                        futures = _encode_part(part, job, pool, codec, layer_ids)
                        if futures:
                            waited = writer.put(futures)
                            wait_s += waited
                            report(Progress(job.rank, wait_s=waited))
                    pending = []
                except SampleOutOfMemory as e:
                    if job.on_bad_sample == "error":
                        raise
                    # Parts come in sample order: the ones before this sample are written.
                    writer.put([_done(_Skip(e.sample_id, str(e)))])
                    pending = pending[pending.index(e.sample_id) + 1 :]
        writer.finish()
    except BaseException:
        writer.error = writer.error or RuntimeError("extraction stopped")
        writer.writer.abort()
        raise
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    summary = writer.summary
    summary.compute_s = time.perf_counter() - started
    summary.wait_s = wait_s
    return summary


def _done(result) -> Future:
    future: Future = Future()
    future.set_result(result)
    return future


def _encode_part(part: Part, job: RankJob, pool: ThreadPoolExecutor, codec: str, layer_ids: list[int]) -> list[Future]:
    """Check and encode every new sample of a part on the device, start one async copy to the host,
    and hand each sample's compression to the pool."""
    out = part.output
    kept: list[tuple[Sample, int]] = []
    futures: list[Future] = []
    planes, scales, target_ids, topk_ids, topk_logprobs = [], [], [], [], []
    for b, sid in enumerate(part.sample_ids):
        if sid in job.done:
            continue
        n = int(part.lengths[b])
        hidden = out.hidden[b, :n]
        problem = check_sample(hidden, layer_ids)
        if problem is not None:
            if job.on_bad_sample == "error":
                raise DFlashCacheError(f"sample {sid}: {problem}; rerun with --on-bad-sample skip to leave such samples out")
            futures.append(_done(_Skip(sid, problem)))
            continue
        encoded = encode(hidden, codec, len(layer_ids))
        kept.append((job.samples[sid], encoded.planes.numel()))
        planes.append(encoded.planes)
        scales.append(encoded.scales)
        target_ids.append(out.target_ids[b, :n])
        if out.topk_ids is not None:
            topk_ids.append(out.topk_ids[b, :n])
            topk_logprobs.append(out.topk_logprobs[b, :n])
    if kept:
        cat = lambda ts: torch.cat(ts) if ts and ts[0] is not None else None  # noqa: E731
        copy = _HostCopy(*(_to_host(cat(ts)) for ts in (planes, scales, target_ids, topk_ids, topk_logprobs)), ready=None)
        if out.hidden.device.type == "cuda":
            copy.ready = torch.cuda.Event()
            copy.ready.record()
        start = token_start = 0
        for sample, size in kept:
            futures.append(pool.submit(_make_row, sample, copy, start, start + size, token_start, codec, len(layer_ids)))
            start += size
            token_start += len(sample.input_ids)
    return futures
