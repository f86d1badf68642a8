"""One extraction rank: the target runs on this process's main thread; threads only compress and write.

    main thread   batch -> target forward (hooks) -> health counts and encode on the device
                  -> async copy on a side stream into a reusable host slot
    thread pool   wait for the copy -> check -> compress -> Row -> give the slot back
    writer thread rows in order -> ShardWriter (tmp, fsync, rename, journal)

The main thread never waits for the GPU: it only queues work, so the GPU runs back to back. It
blocks only when every staging slot is taken or the writer's queue is full, which bounds host
memory; that time is reported as time waiting on the disk.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_cache.data.dataset import Sample
from dflash_cache.errors import DFlashCacheError
from dflash_cache.extract.checks import describe_problem, layer_health
from dflash_cache.extract.split import Part, SampleOutOfMemory, run_with_split
from dflash_cache.files import faults
from dflash_cache.files.write_errors import write_failed
from dflash_cache.store.codecs import compress, encode, encoded_size, stored_width
from dflash_cache.store.integrity import hash_target_files
from dflash_cache.store.schema import Row
from dflash_cache.store.staging import Uploader
from dflash_cache.store.subspace import spec_basis
from dflash_cache.store.writer import ShardWriter
from dflash_cache.target.batch import Layout, to_device
from dflash_cache.target.head import head_tensors, save_target_files
from dflash_cache.target.parallel import Group
from dflash_cache.target.precision import forward_dtype
from dflash_cache.target.runner import TargetRunner
from dflash_cache.target.target import Target, load_target
from dflash_cache.target.warmup import use_kernel_cache, warm_up

GIL_SWITCH_S = 0.0002


@dataclass
class RankJob:
    root: Path
    target_path: Path
    device: str
    rank: int
    spec: dict
    layout: Layout  # how a batch becomes a target forward (packed rows, or padded buckets)
    batches: list[list[int]]  # this rank's batches, whole (same composition in every run)
    samples: dict[int, Sample]  # the samples of those batches
    done: set[int]  # sample ids already committed or skipped: computed again but not written
    first_shard_index: int
    on_bad_sample: str = "error"
    max_shard_bytes: int = 512 << 20
    compress_threads: int = 4
    staging_slots: int = 4  # host buffers of a whole batch's hidden states (pinned on a GPU)
    queue_depth: int = 4  # parts compressed and waiting for the writer
    write_target_files: bool = False
    kernel_cache: Path | None = None  # compilers' disk caches (None: Triton's own), see warmup.py
    uploader: Uploader | None = None  # extraction to a remote cache: `root` is the staging folder
    group: Group | None = None  # this process's tensor-parallel group (extract --tp); None: the target whole here


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
    compile_s: float = 0.0  # the warm-up forward: kernels compiled and autotuned, or loaded from disk
    on_gpu: bool = True  # False: the CPU, whose warm-up forward compiles nothing


@dataclass
class _Skip:
    sample_id: int
    reason: str


class _StagingRing:
    """Reusable host buffers for the device-to-host copies of hidden-state planes, pinned on a GPU.

    `take` blocks while every slot is in use: that bounds host memory and is where the thread that
    drives the GPU waits when compression or the disk fall behind. Slots are allocated on first use
    and then kept for the whole run (pinning memory is slow).
    """

    def __init__(self, slots: int, slot_bytes: int, pin: bool):
        self.free: queue.Queue[torch.Tensor | None] = queue.Queue()
        self.slot_bytes, self.pin = slot_bytes, pin
        # Pinning gigabytes takes seconds: a thread does it while the target loads and warms up, not in the first batches.
        threading.Thread(target=self._allocate, args=(slots,), daemon=True, name="staging-alloc").start()

    def _allocate(self, slots: int) -> None:
        for _ in range(slots):
            try:
                slot = torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=self.pin)
            except RuntimeError:  # out of pinnable memory now: `take` tries again when the slot is needed
                slot = None
            self.free.put(slot)

    def take(self, nbytes: int, check: Callable[[], None]) -> tuple[torch.Tensor, float]:
        """A free slot of at least `nbytes` and the seconds spent waiting for it; `check` runs while
        waiting and may raise (a dead writer gives no slot back)."""
        start = time.perf_counter()
        while True:
            check()
            try:
                slot = self.free.get(timeout=0.5)
                break
            except queue.Empty:
                continue
        waited = time.perf_counter() - start
        if slot is None or slot.numel() < nbytes:
            slot = torch.empty(max(nbytes, self.slot_bytes), dtype=torch.uint8, pin_memory=self.pin)
        return slot, waited

    def give(self, slot: torch.Tensor) -> None:
        self.free.put(slot)


class _Countdown:
    """Calls `action` once, on the `count`-th call."""

    def __init__(self, count: int, action: Callable[[], None]):
        self.count, self.action, self.lock = count, action, threading.Lock()

    def __call__(self) -> None:
        with self.lock:
            self.count -= 1
            last = self.count == 0
        if last:
            self.action()


@dataclass
class _HostCopy:
    """One part's outputs on the host, the copies in flight until `ready`. Each new sample of the
    part holds a share of the staging slot and gives it back through `release`."""

    planes: torch.Tensor  # uint8 staging slot: the new samples' encoded planes, one after another
    health: torch.Tensor  # int32 [new samples, 2, L], see checks.layer_health
    target_ids: torch.Tensor  # int32 [B * T], the forward's positions flattened
    scales: torch.Tensor | None  # fp32 [new samples' tokens, scale columns] (codecs.scale_columns)
    topk_ids: torch.Tensor | None  # int32 [B * T, K]
    topk_logprobs: torch.Tensor | None  # fp32 [B * T, K]
    ready: torch.cuda.Event | None
    release: Callable[[], None]

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


@dataclass
class _RowTask:
    """Where one sample's results lie in its part's host copy."""

    sample: Sample
    index: int  # among the part's new samples (its row of `health`)
    tokens: slice  # its positions in the forward, flattened
    planes: slice  # bytes of the staging slot
    scales_start: int  # first row in `scales`


def _make_row(task: _RowTask, copy: _HostCopy, codec: str, layer_ids: list[int], on_bad_sample: str) -> Row | _Skip:
    try:
        copy.wait()
        faults.point("extract.compress")
        sample, tokens = task.sample, task.tokens
        n = len(sample.input_ids)
        problem = describe_problem(copy.health[task.index].numpy(), layer_ids, n)
        if problem is not None:
            if on_bad_sample == "error":
                raise DFlashCacheError(
                    f"sample {sample.sample_id}: {problem}; rerun with --on-bad-sample skip to leave such samples out"
                )
            return _Skip(sample.sample_id, problem)
        scales = None if copy.scales is None else copy.scales[task.scales_start : task.scales_start + n]
        row = Row(
            sample_id=sample.sample_id,
            input_ids=sample.input_ids,
            loss_mask=sample.loss_mask,
            target_ids=copy.target_ids[tokens].numpy(),
            hidden=compress(copy.planes[task.planes].numpy(), codec),
            hidden_scales=None if scales is None else scales.numpy().tobytes(),
            topk_ids=None if copy.topk_ids is None else copy.topk_ids[tokens].numpy(),
            topk_logprobs=None if copy.topk_logprobs is None else copy.topk_logprobs[tokens].numpy(),
            record_id=sample.record_id,
        )
        row.record_batch  # noqa: B018 - build (and checksum) it here, in parallel, not on the writer thread
        return row
    finally:
        copy.release()


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
            except (
                OSError
            ) as e:  # a full disk, a file-size limit, a read-only folder: the shard being written is dropped
                self.error = write_failed(
                    f"to {self.writer.root}", self.writer.root, e, "rerun the same command to resume"
                )
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


def run_rank(
    job: RankJob, report: Callable[[Progress], None] = lambda p: None, target: Target | None = None
) -> RankSummary:
    """Extract this rank's batches; `target` may be given already loaded (benchmarks build one in place)."""
    kernels = use_kernel_cache(job.kernel_cache)
    codec = job.spec["codec"]
    on_gpu = torch.device(job.device).type == "cuda"
    if job.group is not None and not job.group.writes:
        return _compute_beside(job, kernels, on_gpu)
    largest = max((sum(len(job.samples[sid].input_ids) for sid in batch) for batch in job.batches), default=0)
    ring = _StagingRing(
        job.staging_slots, encoded_size(codec, largest, stored_width(job.spec)), on_gpu
    )  # pinned while the target loads
    target = target or _load(job)
    shards = _shard_writer(job, target)
    runner = TargetRunner(target, job.spec["layer_ids"], topk=job.spec["topk"])
    encoder = _PartEncoder(job, ring, torch.cuda.Stream(job.device) if on_gpu else None)
    compile_s = warm_up(runner, job.layout, job.device, kernels, one_rank_at_a_time=job.group is None)
    writer = _Writer(shards, report, job.rank, job.queue_depth)
    writer.start()
    started = time.perf_counter()
    # The thread that launches the GPU's kernels must get the GIL back at once from the compression
    # threads, not after Python's default 5 ms switch interval.
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(GIL_SWITCH_S)
    try:
        wait_s = _run_batches(job, runner, encoder, writer, report)
        writer.finish()
    except BaseException:
        writer.error = writer.error or RuntimeError("extraction stopped")
        writer.writer.abort()
        raise
    finally:
        sys.setswitchinterval(switch_interval)
        encoder.pool.shutdown(wait=False, cancel_futures=True)
    summary = writer.summary
    summary.compute_s = time.perf_counter() - started
    summary.wait_s = wait_s
    summary.compile_s = compile_s
    summary.on_gpu = on_gpu
    return summary


def _load(job: RankJob) -> Target:
    target = load_target(
        job.target_path, job.device, forward_dtype(job.device), attention=job.layout.attention, group=job.group
    )
    if target.config_hash != job.spec["target"]["config_hash"]:
        raise DFlashCacheError(f"target {job.target_path} changed while extraction was starting")
    return target


def _compute_beside(job: RankJob, kernels: Path, on_gpu: bool) -> RankSummary:
    """A tensor-parallel group's other processes: each collective its writer's forwards make, in the
    same order (the same batches, the same head gathered), nothing written."""
    target = _load(job)
    if job.write_target_files:
        head_tensors(target)
    runner = TargetRunner(target, job.spec["layer_ids"], topk=job.spec["topk"])
    compile_s = warm_up(runner, job.layout, job.device, kernels, one_rank_at_a_time=False)
    started = time.perf_counter()
    for _part in _parts(job, runner, lambda sid, reason: None):
        pass
    return RankSummary(job.rank, compute_s=time.perf_counter() - started, compile_s=compile_s, on_gpu=on_gpu)


def _flat(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """[B, T, ...] -> [B * T, ...] in `dtype`."""
    return None if t is None else t.reshape(-1, *t.shape[2:]).to(dtype)


def _done(result) -> Future:
    future: Future = Future()
    future.set_result(result)
    return future


class _PartEncoder:
    """Turns a part's device outputs into futures of rows, without waiting for the device: health
    counts and encoding are queued on the GPU, the copies go to the host on a side stream (so they
    overlap the next forward), and the pool checks and compresses each sample once its copy lands."""

    def __init__(self, job: RankJob, ring: _StagingRing, copy_stream: torch.cuda.Stream | None):
        self.job, self.ring, self.copy_stream = job, ring, copy_stream
        self.codec, self.layer_ids = job.spec["codec"], job.spec["layer_ids"]
        self.basis = spec_basis(job.spec, job.root / "target", job.device)
        self.pool = ThreadPoolExecutor(job.compress_threads, thread_name_prefix=f"compress-r{job.rank}")

    def encode(self, part: Part, check: Callable[[], None]) -> tuple[list[Future], float]:
        """The part's futures, in sample order, and the seconds spent waiting for a staging slot."""
        out, fb = part.output, part.batch
        new = [i for i, sid in enumerate(fb.sample_ids) if sid not in self.job.done]
        if not new:
            return [], 0.0
        num_layers = len(self.layer_ids)
        offsets, lengths = fb.token_offsets()[new], fb.lengths[new]
        device = out.hidden.device
        health = layer_health(out.hidden, to_device(offsets, device), to_device(lengths, device), num_layers)
        flat = out.hidden.view(-1, out.hidden.shape[-1])
        encoded = [
            encode(flat[o : o + n], self.codec, num_layers, self.basis)
            for o, n in zip(offsets.tolist(), lengths.tolist())
        ]
        slot, waited = self.ring.take(sum(e.planes.numel() for e in encoded), check)
        tasks, start, scales_start = [], 0, 0
        for index, (i, e) in enumerate(zip(new, encoded)):
            size, o, n = e.planes.numel(), int(offsets[index]), int(lengths[index])
            tasks.append(
                _RowTask(
                    self.job.samples[fb.sample_ids[i]], index, slice(o, o + n), slice(start, start + size), scales_start
                )
            )
            start += size
            scales_start += n
        sources = [
            health,
            _flat(out.target_ids, torch.int32),
            torch.cat([e.scales for e in encoded]) if encoded[0].scales is not None else None,
            _flat(out.topk_ids, torch.int32),
            _flat(out.topk_logprobs, torch.float32),
        ]
        hosts, ready = self._copy([e.planes for e in encoded], [slot[t.planes] for t in tasks], sources)
        copy = _HostCopy(slot, *hosts, ready=ready, release=_Countdown(len(tasks), lambda: self.ring.give(slot)))
        args = (copy, self.codec, self.layer_ids, self.job.on_bad_sample)
        return [self.pool.submit(_make_row, task, *args) for task in tasks], waited

    def _copy(self, planes: list[torch.Tensor], slots: list[torch.Tensor], sources: list[torch.Tensor | None]):
        """Copy each of `planes` into its slot view and each source to new host memory."""
        if self.copy_stream is None:  # on the CPU the outputs already are host tensors
            for src, dst in zip(planes, slots):
                dst.copy_(src)
            return sources, None
        self.copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.copy_stream):
            for src, dst in zip(planes, slots):
                src.record_stream(self.copy_stream)  # freed by the main thread, still read here
                dst.copy_(src, non_blocking=True)
            hosts = []
            for src in sources:
                if src is not None:
                    src.record_stream(self.copy_stream)
                    src = torch.empty(src.shape, dtype=src.dtype, pin_memory=True).copy_(src, non_blocking=True)
                hosts.append(src)
            ready = torch.cuda.Event()
            ready.record(self.copy_stream)
        return hosts, ready


def _shard_writer(job: RankJob, target: Target) -> ShardWriter:
    """This rank's shard writer; rank 0 first writes the target's files and journals their hashes."""
    shards = ShardWriter(
        job.root,
        job.rank,
        job.spec,
        job.first_shard_index,
        job.max_shard_bytes,
        on_journal=job.uploader or (lambda shard_path: None),
    )
    if job.write_target_files:
        save_target_files(target, job.root / "target", head_tensors(target))
        if job.uploader is not None:
            job.uploader.upload_target()
        shards.record_target_files(hash_target_files(job.root / "target"))
    return shards


def _run_batches(
    job: RankJob, runner: TargetRunner, encoder: _PartEncoder, writer: _Writer, report: Callable[[Progress], None]
) -> float:
    """Every batch of the job not yet done, through the target and on to the writer; returns the
    seconds spent waiting on the writer."""
    wait_s = 0.0

    def check_writer() -> None:
        if writer.error is not None:
            raise writer.error

    # Parts come in sample order: when a sample is skipped, the ones before it are written.
    for part in _parts(job, runner, lambda sid, reason: writer.put([_done(_Skip(sid, reason))])):
        futures, waited = encoder.encode(part, check_writer)
        if futures:
            waited += writer.put(futures)
        wait_s += waited
        report(Progress(job.rank, wait_s=waited))
    return wait_s


def _parts(job: RankJob, runner: TargetRunner, on_skip: Callable[[int, str], object]) -> Iterator[Part]:
    """The forward parts of the rank's batches not yet done, in order. A sample the device cannot
    hold stops the run, or with --on-bad-sample skip goes to `on_skip(sample id, reason)` and its
    batch goes on after it."""
    for batch in job.batches:
        pending = list(batch)
        while pending and not all(sid in job.done for sid in pending):
            faults.point("extract.forward")
            try:
                yield from run_with_split(runner, job.layout, [job.samples[sid] for sid in pending], job.device)
                pending = []
            except SampleOutOfMemory as e:
                if job.on_bad_sample == "error":
                    raise
                on_skip(e.sample_id, str(e))
                pending = pending[pending.index(e.sample_id) + 1 :]
