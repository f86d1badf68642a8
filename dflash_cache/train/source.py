"""Where a run's batches come from: one or more caches (`--cache`), or a live target (`--live-target`).

Both give the loop the same things: the samples' keys and lengths, the held-out split, the spec the
drafter config is fitted to, the frozen target head, and the FeatureBatch of every batch of keys.
Everything after the source is shared, so a live run is the coupled baseline of a cache run.

A live target is per rank: each training rank runs its own copy of the target, on `--target-gpus`
(one GPU per local rank, in `--gpus` order) or on its own training device.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, closing
from pathlib import Path

import torch

from dflash_cache.drafter.head import TargetHead
from dflash_cache.errors import DFlashCacheError
from dflash_cache.stream.batch import FeatureBatch
from dflash_cache.stream.caches import CacheSet
from dflash_cache.stream.follow import FollowedCache, Waiter
from dflash_cache.stream.loader import Loader
from dflash_cache.target.target import Target
from dflash_cache.train.config import TrainConfig
from dflash_cache.train.distributed import visible_gpus
from dflash_cache.train.live import LiveSource
from dflash_cache.train.model import check_head

Batches = AbstractContextManager[Iterator[FeatureBatch]]


class Source(ABC):
    """The samples (keyed as in `CacheSet`) and how to turn batches of keys into FeatureBatches."""

    def __init__(self, keyed: CacheSet | LiveSource):
        self.keyed = keyed
        self.spec: dict = keyed.spec
        self.lengths: list[int] = keyed.lengths
        self.tokenizer_dir: Path = keyed.head_dir
        self.where = ""  # said after a batch's description in errors

    def split(self, eval_fraction: float) -> tuple[list[int], list[int]]:
        return self.keyed.split(eval_fraction)

    def describe_batch(self, batch: FeatureBatch, limit: int = 16) -> str:
        """A batch as errors name it: its size and its first sample ids."""
        ids = ", ".join(str(s) for s in batch.sample_ids[:limit]) + (", ..." if len(batch.sample_ids) > limit else "")
        return f"a batch of {batch.num_tokens} tokens in {batch.num_sequences} sequences (sample ids {ids}){self.where}"

    def check(self) -> None:  # noqa: B027 - a default that checks nothing, not a method to implement
        """Raises if the target files the drafter config reads are damaged."""

    def close(self) -> None:
        self.keyed.close()

    @abstractmethod
    def describe(self) -> str:
        """'N samples in ...', for the run's first lines."""

    @abstractmethod
    def identity(self) -> tuple[list[dict], list[int]]:
        """The spec and sample count of each part of the source: a resumed run must have the same."""

    @abstractmethod
    def head(self, device: torch.device) -> TargetHead:
        """The frozen target head (embeddings, final norm, LM head) in bf16 on `device`."""

    @abstractmethod
    def batches(self, plan: Sequence[Sequence[int]], device: torch.device) -> Batches:
        """A context yielding the FeatureBatch of each batch of keys of `plan`, in order, on `device`."""


class CacheSource(Source):
    """Caches read through the prefetching loader."""

    def __init__(self, caches: CacheSet, prefetch: int, workers: int, topk: bool = False):
        """`topk`: batches carry the caches' top-K labels, which they must have."""
        super().__init__(caches)
        self.caches = caches
        self.prefetch = prefetch
        self.workers = workers
        self.topk = topk
        self.where = "" if len(caches.caches) == 1 else " (union of caches)"

    def check(self) -> None:
        check_head(self.caches)
        if self.topk and not self.spec.get("topk"):
            raise DFlashCacheError(
                f"--loss topk needs the target's top-K labels, which {self.caches.caches[0].root} lacks: "
                "extract it with --topk K (e.g. --topk 8), or train with --loss dflash or dpace"
            )
        for cache in self.caches.caches:
            masked = cache.manifest.get("extract", {}).get("masked_tokens")
            if masked is not None and sum(masked.values()) == 0:
                raise DFlashCacheError(
                    f"{cache.root} holds no token to train on (every loss mask is zero); extract it again from "
                    "data with assistant turns within --max-length"
                )
            cache.check_shards()  # a missing shard is found now, not steps into the run

    def describe(self) -> str:
        return f"{len(self.caches)} samples in {len(self.caches.caches)} cache(s)"

    def identity(self) -> tuple[list[dict], list[int]]:
        return [c.spec for c in self.caches.caches], [len(c) for c in self.caches.caches]

    def head(self, device: torch.device) -> TargetHead:
        return TargetHead.load(check_head(self.caches), device=device)

    def batches(self, plan: Sequence[Sequence[int]], device: torch.device) -> Batches:
        return Loader(self.caches, plan, device, self.prefetch, self.workers, self.topk)


class FollowSource(CacheSource):
    """One cache read as its extraction commits shards (`--follow`), its samples growing as they are consumed."""

    def __init__(self, caches: FollowedCache, waiter: Waiter, prefetch: int, workers: int, topk: bool = False):
        super().__init__(caches, prefetch, workers, topk)
        self.followed = caches
        self.waiter = waiter

    def describe(self) -> str:
        return f"{self.followed.root}, followed while it is extracted"

    def identity(self) -> tuple[list[dict], list[int]]:
        return [self.spec], []  # its size is not known before its extraction ends


class LiveTargetSource(Source):
    """The target computing each batch when the loop asks for it, with no read-ahead."""

    def __init__(self, live: LiveSource):
        super().__init__(live)
        self.live = live

    def describe(self) -> str:
        forwards = (
            "one sample per target forward"
            if self.live.forward_tokens is None
            else f"target forwards of <= {self.live.forward_tokens} padded tokens"
        )
        return f"{len(self.live)} samples computed live by {self.live.info.path} ({forwards})"

    def identity(self) -> tuple[list[dict], list[int]]:
        # How the target groups samples changes their bf16 rounding, so a resumed run must keep it.
        return [{**self.live.spec, "forward_tokens": self.live.forward_tokens}], [len(self.live)]

    def head(self, device: torch.device) -> TargetHead:
        return self.live.head(device)

    def batches(self, plan: Sequence[Sequence[int]], device: torch.device) -> Batches:
        return closing(self.live.batches(plan, device))


def open_source(
    cfg: TrainConfig,
    target_device: str = "cpu",
    target: Target | None = None,
    echo: Callable[[str], None] | None = None,
) -> Source:
    """The source `cfg` names. A live target loads on `target_device` when first used, unless `target`
    gives it already loaded (benchmarks build one in place). `echo`: where a followed cache's waits are said."""
    if cfg.follow:
        waiter = Waiter(Path(cfg.caches[0]), cfg.follow_timeout_s, echo)
        followed = FollowedCache(cfg.caches[0], waiter, cfg.max_open_shards)
        return FollowSource(followed, waiter, cfg.prefetch, cfg.workers, topk=cfg.loss == "topk")
    if cfg.live_target is None:
        caches = CacheSet(cfg.caches, cfg.local_cache, cfg.local_cache_bytes, cfg.max_open_shards, verify_shards=True)
        return CacheSource(caches, cfg.prefetch, cfg.workers, topk=cfg.loss == "topk")
    live = LiveSource(
        target or cfg.live_target,
        cfg.data,
        cfg.layers,
        cfg.num_draft_layers,
        target_device,
        cfg.max_length,
        forward_tokens=None if cfg.exact_target else cfg.token_budget,
    )
    return LiveTargetSource(live)


def check_target_gpus(cfg: TrainConfig, ranks: int) -> None:
    """--target-gpus names one visible GPU per local training rank."""
    if cfg.target_gpus is None:
        return
    if len(cfg.target_gpus) != ranks:
        raise DFlashCacheError(
            f"--target-gpus names {len(cfg.target_gpus)} GPU(s) for {ranks} training rank(s); "
            "give one per rank, in --gpus order"
        )
    visible = visible_gpus()
    if missing := [g for g in cfg.target_gpus if g not in visible]:
        raise DFlashCacheError(f"--target-gpus names GPUs {missing} but this machine has {len(visible)} visible GPU(s)")


def target_device(cfg: TrainConfig, local: int, device: str) -> str:
    """Where the live target of local rank `local`, training on `device`, runs."""
    return device if cfg.target_gpus is None else f"cuda:{cfg.target_gpus[local]}"
