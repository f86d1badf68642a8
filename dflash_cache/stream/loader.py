"""The prefetching loader: cache rows -> packed `FeatureBatch` on the training device.

Two stages, both ahead of the step that consumes the batch:

1. Host (a thread pool): each row of a batch is read, checksum-verified and zstd-decompressed by one
   task straight into its slice of the batch's host buffers (pinned when the device is a GPU).
   Offsets come from the manifest lengths, so rows fill in parallel and no copy happens after. At most `prefetch` batches are in this stage, which bounds host memory.
2. Device (the main thread): the encoded buffers are copied to the GPU on a side stream and decoded
   there (byte-plane merge, fp8 or fp4 scaling); the consuming stream waits on an event. The next batch
   is sent while the current one trains. On the CPU the same code runs without pinning or streams.

Batches are packed, never padded, and no buffer is cached per shape.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Self

import numpy as np
import torch

from dflash_cache.errors import DFlashCacheError
from dflash_cache.store.codecs import decode, decompress_into, plane_layout, scale_columns
from dflash_cache.store.schema import Row
from dflash_cache.stream.batch import FeatureBatch
from dflash_cache.stream.caches import CacheSet


class ReaderError(RuntimeError):
    """An unexpected failure while reading a row, raised in the training loop."""


@dataclass
class HostBatch:
    """A batch with its hidden states still encoded, packed token after token."""

    keys: list[int]
    sample_ids: list[int]
    # Where each sample starts, then the total (cu_seqlens as ints): reader threads make no torch
    # calls, since each releases and retakes the GIL and every retake can hold up the training thread.
    offsets: list[int]
    input_ids: torch.Tensor  # int64 [N]
    loss_mask: torch.Tensor  # bool [N]
    target_ids: torch.Tensor  # int64 [N]
    planes: torch.Tensor  # uint8 [P, N * width * bytes]: plane p of every sample, in order
    scales: torch.Tensor | None  # fp32 [N, L] for the fp8 and fp4 codecs
    cu_seqlens: torch.Tensor  # int32 [S+1]
    topk_ids: torch.Tensor | None = None  # int64 [N, K], when the loader reads the top-K labels
    topk_logprobs: torch.Tensor | None = None  # fp32 [N, K]


def empty_host_batch(
    caches: CacheSet, keys: Sequence[int], pin: bool, capacity_tokens: int = 0, topk: bool = False
) -> HostBatch:
    """Host buffers for a batch. The planes sit at the front of a buffer sized for `capacity_tokens`
    (the largest batch of the run), so every batch asks the pinned-memory cache for the same size and
    reuses a freed block: sizes that vary from batch to batch fall into different power-of-two
    classes, and each new class costs a fresh page-locking allocation on the training thread.
    `topk`: with buffers for the cache's top-K labels."""
    offsets = [0, *itertools.accumulate(caches.lengths[k] for k in keys)]
    n = offsets[-1]
    num_planes, token_bytes = plane_layout(caches.codec, caches.width)
    new = lambda *shape, dtype: torch.empty(shape, dtype=dtype, pin_memory=pin)
    columns = scale_columns(caches.spec)
    plane_bytes = n * token_bytes
    k = caches.spec.get("topk", 0) if topk else 0
    buffer = new(num_planes * max(n, capacity_tokens) * token_bytes, dtype=torch.uint8)
    return HostBatch(
        keys=list(keys),
        sample_ids=[caches.sample_id(k) for k in keys],
        offsets=offsets,
        input_ids=new(n, dtype=torch.int64),
        loss_mask=new(n, dtype=torch.bool),
        target_ids=new(n, dtype=torch.int64),
        planes=buffer[: num_planes * plane_bytes].view(num_planes, plane_bytes),
        scales=new(n, columns, dtype=torch.float32) if columns else None,
        cu_seqlens=new(len(offsets), dtype=torch.int32).copy_(torch.tensor(offsets, dtype=torch.int32)),
        topk_ids=new(n, k, dtype=torch.int64) if k else None,
        topk_logprobs=new(n, k, dtype=torch.float32) if k else None,
    )


def check_token_ids(row: Row, vocab: int, topk: bool = False) -> None:
    """Token ids index the target's embeddings and, as labels, each row of the LM-head loss's logits,
    whose GPU kernel reads the label's logit unchecked: an id outside the vocabulary, in a damaged or
    foreign cache, stops here rather than there. `topk`: the top-K ids too (when the batch reads them)."""
    for name in ("input_ids", "target_ids", *(("topk_ids",) if topk else ())):
        ids = getattr(row, name)
        if ids is None:
            continue
        outside = (ids < 0) | (ids >= vocab)
        if outside.any():
            raise DFlashCacheError(
                f"{name} holds token id {ids[outside][0]}, outside the target's vocabulary of "
                f"{vocab}: the cache is damaged or was not written for this target"
            )


def fill_row(caches: CacheSet, batch: HostBatch, index: int) -> None:
    """Read, verify and decompress row `index` of the batch into its slice of the host buffers."""
    key = batch.keys[index]
    start, end = batch.offsets[index], batch.offsets[index + 1]
    try:
        row = caches.read(key)  # its token count checked against the manifest's
        check_token_ids(row, caches.spec["target"]["vocab_size"], topk=batch.topk_ids is not None)
        planes = batch.planes.numpy()
        per_token = planes.shape[1] // batch.offsets[-1]
        decompress_into(row.hidden, caches.codec, planes[:, start * per_token : end * per_token])
        if batch.scales is not None:
            scales = batch.scales.numpy()[start:end]
            if row.hidden_scales is None or len(row.hidden_scales) != scales.nbytes:
                raise DFlashCacheError(
                    f"hidden scales hold {len(row.hidden_scales or b'')} bytes, expected {scales.nbytes}"
                )
            np.copyto(scales, np.frombuffer(row.hidden_scales, dtype=np.float32).reshape(scales.shape))
    except DFlashCacheError as e:
        raise DFlashCacheError(f"reading {caches.describe(key)}: {e}") from None
    except Exception as e:
        raise ReaderError(f"reader thread failed on {caches.describe(key)}: {type(e).__name__}: {e}") from e
    batch.input_ids.numpy()[start:end] = row.input_ids
    batch.loss_mask.numpy()[start:end] = row.loss_mask
    batch.target_ids.numpy()[start:end] = row.target_ids
    if batch.topk_ids is not None:
        k = batch.topk_ids.shape[1]
        if (
            row.topk_ids is None
            or len(row.topk_ids) != (end - start) * k
            or len(row.topk_logprobs) != len(row.topk_ids)
        ):
            raise DFlashCacheError(
                f"reading {caches.describe(key)}: its top-K labels are missing or not {k} a token; the cache is damaged"
            )
        batch.topk_ids.numpy()[start:end] = row.topk_ids.reshape(-1, k)
        batch.topk_logprobs.numpy()[start:end] = row.topk_logprobs.reshape(-1, k)


def to_device(host: HostBatch, codec: str, width: int, device: torch.device) -> FeatureBatch:
    """Copy (non-blocking from pinned memory) and decode on the current stream of `device`."""
    move = lambda t: t.to(device, non_blocking=True)
    n = host.input_ids.shape[0]
    scales = None if host.scales is None else move(host.scales)
    return FeatureBatch(
        sample_ids=host.sample_ids,
        input_ids=move(host.input_ids),
        loss_mask=move(host.loss_mask),
        target_ids=move(host.target_ids),
        hidden=decode(move(host.planes).reshape(-1), scales, codec, n, width),
        cu_seqlens=move(host.cu_seqlens),
        topk_ids=None if host.topk_ids is None else move(host.topk_ids),
        topk_logprobs=None if host.topk_logprobs is None else move(host.topk_logprobs),
    )


class Loader:
    """Iterates the FeatureBatches of `batches` (lists of keys) in order, reading ahead.

    An error in a reader thread is raised by the next `__next__` that sees it (it waits on every
    pending row, not only the head batch's). Use as a context manager, or call `close()`. `topk`: the
    batches also carry the cache's top-K labels (a cache extracted with --topk).
    """

    def __init__(
        self,
        caches: CacheSet,
        batches: Sequence[Sequence[int]],
        device: torch.device | str,
        prefetch: int = 4,
        workers: int = 8,
        topk: bool = False,
    ):
        if prefetch < 1 or workers < 1:
            raise DFlashCacheError(f"--prefetch and --workers must be at least 1 (got {prefetch}, {workers})")
        self.caches = caches
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.prefetch = prefetch
        self.topk = topk
        self._todo = deque(batches)
        self._capacity = max((sum(caches.lengths[k] for k in batch) for batch in self._todo), default=0)
        self._host: deque[tuple[HostBatch, list[cf.Future]]] = deque()
        self._staged: tuple[FeatureBatch, torch.cuda.Event | None] | None = None
        self._pool = cf.ThreadPoolExecutor(workers, thread_name_prefix="dflash-reader")
        self._side = torch.cuda.Stream(self.device) if self.cuda else None
        self._fill()

    def _fill(self) -> None:
        while self._todo and len(self._host) < self.prefetch:
            batch = empty_host_batch(
                self.caches, self._todo.popleft(), pin=self.cuda, capacity_tokens=self._capacity, topk=self.topk
            )
            # Rows in shard order: a shard's rows in this batch are read while it is open in the pool.
            order = sorted(range(len(batch.keys)), key=lambda i: self.caches.read_order(batch.keys[i]))
            futures = [self._pool.submit(fill_row, self.caches, batch, i) for i in order]
            self._host.append((batch, futures))

    def _head_ready(self, block: bool) -> bool:
        """Whether the oldest host batch is complete; raises the first error of any pending row."""
        if not self._host:
            return False
        while True:
            pending = []
            for _, futures in self._host:
                for f in futures:
                    if not f.done():
                        pending.append(f)
                    elif f.exception() is not None:
                        raise f.exception()
            if all(f.done() for f in self._host[0][1]):
                return True
            if not block:
                return False
            cf.wait(pending, return_when=cf.FIRST_COMPLETED)

    def _stage(self) -> None:
        """Send the oldest host batch to the device (on the side stream when there is one)."""
        host, _ = self._host.popleft()
        self._fill()
        if not self.cuda:
            self._staged = (to_device(host, self.caches.codec, self.caches.width, self.device), None)
            return
        with torch.cuda.stream(self._side):
            batch = to_device(host, self.caches.codec, self.caches.width, self.device)
            done = torch.cuda.Event()
            done.record(self._side)
        self._staged = (batch, done)

    def __iter__(self) -> Iterator[FeatureBatch]:
        return self

    def __next__(self) -> FeatureBatch:
        if self._staged is None:
            if not self._host:
                raise StopIteration
            self._head_ready(block=True)
            self._stage()
        batch, done = self._staged
        self._staged = None
        if done is not None:
            consumer = torch.cuda.current_stream(self.device)
            consumer.wait_event(done)
            for t in (
                batch.input_ids,
                batch.loss_mask,
                batch.target_ids,
                batch.hidden,
                batch.cu_seqlens,
                batch.topk_ids,
                batch.topk_logprobs,
            ):
                if t is not None:
                    t.record_stream(consumer)  # allocated on the side stream, used on this one
        if self.cuda and self._head_ready(block=False):
            self._stage()  # the copy of the next batch overlaps this batch's step
        return batch

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)  # a row being read finishes on its own
        self._host.clear()
        self._todo.clear()
        self._staged = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
